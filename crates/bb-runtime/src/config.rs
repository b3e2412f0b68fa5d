//! The runtime's configuration: where its state lives and the limits requests are held to.

use bb_layers::IdMap;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub state_dir: PathBuf,
    /// Path of the `branchbox-init` binary.
    pub init_bin: PathBuf,
    pub idmap: IdMap,
    /// cgroup under which every sandbox gets its own group.
    pub cgroup_parent: String,
    pub max_sandboxes: usize,
    /// Upper bounds a create request may ask for.
    pub max_memory_mb: u64,
    pub max_cpu: f64,
    pub max_pids: u64,
    /// Largest file upload, bytes.
    pub max_file_bytes: u64,
    /// Live session templates kept for snapshots (LRU beyond this).
    pub max_templates: usize,
    /// Snapshot layers stacked under a sandbox's writable layer before the oldest are merged
    /// (see [`crate::compaction::MAX_CHAIN`]).
    pub max_chain: usize,
    /// CRIU, and the helper that runs it in a sandbox's namespaces (next to `init_bin`).
    pub criu_bin: PathBuf,
    pub criu_exec_bin: PathBuf,
    /// Disk the process images may use (bytes).
    pub max_image_bytes: u64,
    /// Restore process images lazily where the kernel allows ([`bb_criu::lazy`]).
    pub lazy_pages: bool,
    /// Lets the daemon's injected `setns` through the sandboxes' seccomp filters (see
    /// `bb_isolation::SetnsKey`). Loaded from `<state>/setns.key` by [`crate::Runtime::open`].
    pub setns_key: [u64; 2],
    /// Where the setns key is kept (default `<state>/setns.key`).
    pub setns_key_file: Option<PathBuf>,
    /// Where pushed snapshots go ([`crate::remote`]): `file:///dir` or
    /// `s3://bucket/prefix?endpoint=...&region=...` (S3 credentials from the daemon's
    /// environment). Default: `<state>/store`.
    pub store_url: Option<String>,
    /// S3 access key id and secret (the daemon took them from its environment at start).
    pub store_credentials: Option<(String, String)>,
    /// The metadata store shared by the daemons of one store: `postgres://...`, or a SQLite
    /// file. Default: this daemon's own database (then only it sees its pushes).
    pub metadata_url: Option<String>,
    /// The deployment's store key (32 bytes; made, mode 0600, if missing). Every daemon sharing
    /// a store needs the same one. Default: `<state>/store.key`.
    pub store_key_file: Option<PathBuf>,
    /// This daemon's name in the records it pushes. Default: the host name.
    pub node_name: Option<String>,
    /// Unreachable objects younger than this are kept by the store's collection.
    pub store_gc_grace: std::time::Duration,
    /// Keep the volumes' layers on an encrypted filesystem of the daemon's own
    /// ([`crate::volumes::volfs`]).
    pub volume_encryption: bool,
    /// Where the volumes' master key is kept (64 bytes; made, mode 0600, if missing). Default:
    /// `<state>/volume.key`.
    pub volume_key_file: Option<PathBuf>,
    /// Size of the volumes' filesystem (a sparse image: it takes the space its files take).
    pub volume_fs_bytes: u64,
    /// Most bytes of frozen volume layers kept on the node ([`crate::volumes::cache`]); None:
    /// no bound.
    pub volume_cache_bytes: Option<u64>,
    /// Address the host side of sandbox ports listens on ([`crate::net::ports`]).
    pub port_bind: std::net::IpAddr,
    /// The bridge sandboxes with egress are wired to ([`crate::net`]); its nftables table is
    /// `inet branchbox_{bridge}`. One per daemon on a host.
    pub net_bridge: String,
    /// The addresses of sandboxes with egress (the bridge takes the first).
    pub net_range: ipnet::Ipv4Net,
    /// Where the daemon's DNS forwards allowed queries. None: the first nameserver of the host's
    /// /etc/resolv.conf.
    pub net_dns: Option<std::net::SocketAddr>,
    /// The daemon's TCP listener as clients reach it, with the domain of the Host-header form of
    /// ports (`{port}-{sandbox}.{domain}`): e.g. `localhost:7070`. None: no TCP listener.
    pub port_domain: Option<String>,
    /// Port of the daemon's proxy inside sandboxes that ask for it ([`crate::net::proxy`]).
    pub proxy_port: u16,
    /// Headers the proxy adds per host (a JSON file; see [`crate::net::proxy::Credential`]).
    pub proxy_credentials: Option<PathBuf>,
    /// CA certificates (PEM) the proxy trusts upstream, beside the system's.
    pub proxy_ca: Option<PathBuf>,
    /// How long a sandbox whose lifecycle pauses it at its timeout may go on running while its
    /// full pause is refused (a command or session request that does not end) or fails before it
    /// is paused with its files only ([`crate::Runtime::pause_expired`]).
    pub timeout_pause_grace: std::time::Duration,
}

impl RuntimeConfig {
    pub fn new(state_dir: PathBuf, init_bin: PathBuf) -> Self {
        let criu_exec_bin = init_bin.with_file_name("branchbox-criu-exec");
        RuntimeConfig {
            state_dir,
            init_bin,
            idmap: IdMap::default(),
            cgroup_parent: "branchbox".into(),
            max_sandboxes: 1000,
            max_memory_mb: 64 * 1024,
            max_cpu: 64.0,
            max_pids: 65536,
            max_file_bytes: 4 << 30,
            max_templates: 64,
            max_chain: crate::compaction::MAX_CHAIN,
            setns_key: [0, 0],
            setns_key_file: None,
            criu_bin: PathBuf::from("/usr/local/lib/branchbox/criu"),
            criu_exec_bin,
            max_image_bytes: 8 << 30,
            lazy_pages: true,
            store_url: None,
            store_credentials: None,
            metadata_url: None,
            store_key_file: None,
            node_name: None,
            store_gc_grace: std::time::Duration::from_secs(3600),
            volume_encryption: true,
            volume_key_file: None,
            volume_fs_bytes: 256 << 30,
            volume_cache_bytes: None,
            port_bind: std::net::Ipv4Addr::LOCALHOST.into(),
            net_bridge: "bb0".into(),
            net_range: ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 213, 0, 0), 16).expect("literal"),
            net_dns: None,
            port_domain: None,
            proxy_port: crate::net::proxy::DEFAULT_PORT,
            proxy_credentials: None,
            proxy_ca: None,
            timeout_pause_grace: std::time::Duration::from_secs(300),
        }
    }

    /// The volumes' key file.
    pub fn volume_key(&self) -> PathBuf {
        self.volume_key_file.clone().unwrap_or_else(|| self.state_dir.join("volume.key"))
    }
}
