//! `branchboxd`: the branchbox daemon.
//!
//! Opens the runtime on its state directory (re-attaching to or reaping sandboxes a previous run
//! left), serves the API on a unix socket (and on TCP with a bearer token when asked), and kills
//! sandboxes whose timeout has passed. Sandboxes outlive a daemon restart unless `--kill-on-exit`;
//! the warm pool's ready sandboxes, which belong to nobody, are torn down on a clean shutdown.

use anyhow::{bail, Context};
use bb_runtime::{Runtime, RuntimeConfig};
use clap::Parser;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "branchboxd", version, about = "branchbox sandbox daemon")]
struct Args {
    /// State directory (images, layers, sandboxes, database).
    #[arg(long, env = "BRANCHBOX_STATE_DIR", default_value = "/var/lib/branchbox")]
    state_dir: PathBuf,
    /// Unix socket to serve the API on.
    #[arg(long, env = "BRANCHBOX_SOCKET", default_value = "/run/branchbox/branchboxd.sock")]
    socket: PathBuf,
    /// Also serve on this TCP address (e.g. 127.0.0.1:7070); requires --token.
    #[arg(long)]
    listen: Option<String>,
    /// Bearer token required on TCP.
    #[arg(long, env = "BRANCHBOX_TOKEN")]
    token: Option<String>,
    /// Path of branchbox-init (default: next to this binary).
    #[arg(long, env = "BRANCHBOX_INIT_BIN")]
    init_bin: Option<PathBuf>,
    /// cgroup under which sandboxes get their groups.
    #[arg(long, default_value = "branchbox")]
    cgroup_parent: String,
    #[arg(long, default_value_t = 1000)]
    max_sandboxes: usize,
    /// Largest file upload in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    max_file_bytes: u64,
    /// Live session templates kept for snapshots; beyond it the least recently used is evicted
    /// (its snapshots still roll back, with sessions restarted fresh)
    #[arg(long, default_value_t = 64)]
    max_templates: usize,
    /// CRIU (4.1 or newer): session templates that leave the in-memory pool are kept as process
    /// images, so a rollback to their snapshots restores the sessions. Without it (not found,
    /// too old) the daemon runs without process images and says so at start and in `health`.
    #[arg(long, env = "BRANCHBOX_CRIU", default_value = "/usr/local/lib/branchbox/criu")]
    criu: PathBuf,
    /// Disk the process images may use, in bytes; beyond it the least recently used are deleted
    /// (their sessions restart fresh on rollback).
    #[arg(long, default_value_t = 8 << 30)]
    max_image_bytes: u64,
    /// Restore process images with all their memory read up front, instead of lazily (processes
    /// run at once and their memory is copied in after, through userfaultfd).
    #[arg(long)]
    no_lazy_pages: bool,
    /// Snapshot layers a sandbox's root may stack before the oldest are merged into one, in the
    /// background (compaction; snapshots keep their content). At least 2.
    #[arg(long, env = "BRANCHBOX_MAX_CHAIN", default_value_t = bb_runtime::compaction::MAX_CHAIN)]
    max_chain: usize,
    /// First host uid/gid of the sandboxes' user namespace range (65536 ids). Images and sandbox
    /// files are owned by these ids: the state dir records the value on first start, and later
    /// starts with another value are refused.
    #[arg(long, default_value_t = 1_000_000)]
    uid_base: u32,
    /// Warm pool: sandboxes of the default image ("base") kept ready, so creates claim one
    /// instead of starting cold; killed sandboxes are recycled into it up to twice this. 0 = no
    /// pool. A size set through the API (`PUT /v1/pool/{image}`) takes precedence.
    #[arg(long, default_value_t = 2)]
    pool_size: usize,
    /// Kill every sandbox when the daemon exits (default: they survive and are re-attached).
    #[arg(long)]
    kill_on_exit: bool,
    /// Object store for pushed snapshots: `file:///dir` or
    /// `s3://bucket/prefix?endpoint=http://host:port&region=...` (S3 credentials from
    /// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the daemon's environment; never passed to a
    /// sandbox). Default: `<state-dir>/store`.
    #[arg(long, env = "BRANCHBOX_STORE_URL")]
    store_url: Option<String>,
    /// Metadata store shared by the daemons of one object store: `postgres://user:pw@host/db`
    /// or a SQLite file. Default: the daemon's own database (only it sees its pushes).
    #[arg(long, env = "BRANCHBOX_METADATA_URL")]
    metadata_url: Option<String>,
    /// The deployment's store key (32 bytes, made with mode 0600 if missing); every daemon of
    /// one object store needs the same key. Default: `<state-dir>/store.key`.
    #[arg(long, env = "BRANCHBOX_STORE_KEY_FILE")]
    store_key_file: Option<PathBuf>,
    /// The key that lets this daemon's injected `setns` through sandbox seccomp filters (16
    /// bytes, made with mode 0600 if missing). Processes restored from process images carry the
    /// key of the daemon that started them: daemons sharing an object store share this file,
    /// or live forks of pulled snapshots start fresh sessions. Default: `<state-dir>/setns.key`.
    #[arg(long, env = "BRANCHBOX_SETNS_KEY_FILE")]
    setns_key_file: Option<PathBuf>,
    /// This daemon's name in the snapshot records it pushes. Default: the host name.
    #[arg(long)]
    node_name: Option<String>,
    /// Seconds an unreachable object of the object store is kept before `store gc` deletes it
    /// (uploads in flight on other daemons are younger).
    #[arg(long, default_value_t = 3600)]
    store_gc_grace: u64,
    /// Seconds between background uploads of synced volumes that changed (0: only on
    /// `volume sync`). A volume is uploaded in the background once it was synced once.
    #[arg(long, default_value_t = 60)]
    volume_sync_interval: u64,
    /// Keep the volumes' layers on an encrypted filesystem of the daemon's own (an ext4 image on
    /// a loop device, fscrypt): `on` or `off` (plain directories of the state dir).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    volume_encryption: String,
    /// Where the volumes' master key is kept (made, mode 0600, if missing). Default:
    /// `<state>/volume.key`.
    #[arg(long, env = "BRANCHBOX_VOLUME_KEY_FILE")]
    volume_key_file: Option<PathBuf>,
    /// Size in GiB of the volumes' filesystem when it is made (a sparse image: it takes the
    /// space its files take; keep that much free on the state dir's disk).
    #[arg(long, default_value_t = 256)]
    volume_fs_size_gb: u64,
    /// Most MiB of frozen volume layers kept on this node (0: no bound). Past it, layers of
    /// volumes that are durable (synced, unchanged since) and idle go, least recently used
    /// first, and are pulled back from the object store when the volume is next used.
    #[arg(long, default_value_t = 64 * 1024)]
    volume_cache_mb: u64,
    /// Address the host side of sandbox ports (`GET /v1/sandboxes/{id}/ports/{port}`) listens
    /// on. Anyone who reaches it reaches the sandbox's server: keep it on loopback unless a
    /// firewall guards it.
    #[arg(long, default_value = "127.0.0.1")]
    port_bind: std::net::IpAddr,
    /// Bridge that sandboxes with egress (network `allowlist` or `open`) are wired to, made on
    /// first use; its nftables table is `inet branchbox_{bridge}`. One per daemon on a host (at
    /// most 8 characters).
    #[arg(long, default_value = "bb0")]
    net_bridge: String,
    /// Addresses of sandboxes with egress (IPv4 CIDR; the bridge takes the first). No other
    /// network of the host may use it.
    #[arg(long, default_value = "10.213.0.0/16")]
    net_range: ipnet::Ipv4Net,
    /// Upstream DNS server (address:port) the daemon forwards sandboxes' allowed queries to.
    /// Default: the first nameserver of /etc/resolv.conf.
    #[arg(long)]
    net_dns: Option<std::net::SocketAddr>,
    /// Domain of the Host-header form of sandbox ports on the TCP listener (`--listen`): a
    /// request to `{port}-{sandbox}.{domain}` reaches that port of that sandbox (no token).
    #[arg(long, default_value = "localhost")]
    port_domain: String,
    /// Port of the daemon's HTTP(S) proxy inside sandboxes created with `proxy: true`
    /// (127.0.0.1 in each sandbox's own network namespace).
    #[arg(long, default_value_t = bb_runtime::net::proxy::DEFAULT_PORT, value_parser = clap::value_parser!(u16).range(1..))]
    proxy_port: u16,
    /// JSON file of headers the proxy adds per host, never seen by sandboxes:
    /// {"api.example.com": {"headers": {"Authorization": "Bearer ..."}, "tls": true}}.
    #[arg(long)]
    proxy_credentials: Option<PathBuf>,
    /// PEM file of CA certificates the proxy trusts upstream (beside the system's).
    #[arg(long)]
    proxy_ca: Option<PathBuf>,
    /// Seconds a sandbox whose lifecycle pauses it at its timeout may go on running while its
    /// full pause is refused (a command that does not end, e.g. a server started through the E2B
    /// endpoint, or a session request) or fails; then it is paused with its files only (its
    /// processes end). Such pauses are tried again every minute (or every GRACE seconds, if
    /// shorter).
    #[arg(long, default_value_t = 300)]
    timeout_pause_grace: u64,
    /// Serve an E2B-compatible endpoint on this TCP address (e.g. 127.0.0.1:49999): E2B's SDKs
    /// reach it with E2B_API_URL and E2B_SANDBOX_URL set to `http://ADDR` and E2B_API_KEY to the
    /// daemon's token (--token, required). Off by default.
    #[arg(long)]
    e2b_listen: Option<String>,
    /// The `domain` the E2B endpoint answers for its sandboxes: `{port}-{sandboxID}.{domain}` on
    /// the E2B listener reaches that port of that sandbox.
    #[arg(long, default_value = "localhost")]
    e2b_domain: String,
    /// Print the OpenAPI document and exit.
    #[arg(long)]
    print_openapi: bool,
}

/// S3 credentials from the environment, which is then cleared of them (and of the metadata URL,
/// which may hold a password): no child the daemon starts (CRIU, a sandbox's init) inherits
/// them. Runs before any thread exists.
fn take_secrets() -> Option<(String, String)> {
    let id = std::env::var("AWS_ACCESS_KEY_ID").ok();
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").ok();
    for k in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "BRANCHBOX_METADATA_URL"] {
        std::env::remove_var(k);
    }
    id.zip(secret)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let store_credentials = take_secrets();
    if args.print_openapi {
        print!("{}", bb_api::openapi_json());
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("BRANCHBOX_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("branchboxd")
        .build()?
        .block_on(run(args, store_credentials))
}

async fn run(args: Args, store_credentials: Option<(String, String)>) -> anyhow::Result<()> {
    if args.listen.is_some() && args.token.as_deref().unwrap_or("").is_empty() {
        bail!("--listen needs --token (or BRANCHBOX_TOKEN): the TCP API must not be open to anyone");
    }
    if args.e2b_listen.is_some() && args.token.as_deref().unwrap_or("").is_empty() {
        bail!("--e2b-listen needs --token (or BRANCHBOX_TOKEN): it is the endpoint's API key (E2B_API_KEY)");
    }
    let init_bin = match args.init_bin {
        Some(p) => p,
        None => std::env::current_exe()?.with_file_name("branchbox-init"),
    };
    let mut cfg = RuntimeConfig::new(args.state_dir.clone(), init_bin);
    cfg.cgroup_parent = args.cgroup_parent;
    cfg.max_sandboxes = args.max_sandboxes;
    cfg.max_file_bytes = args.max_file_bytes;
    cfg.max_templates = args.max_templates.max(1);
    cfg.criu_bin = args.criu.clone();
    cfg.max_image_bytes = args.max_image_bytes;
    cfg.lazy_pages = !args.no_lazy_pages;
    if args.max_chain < 2 {
        bail!("--max-chain must be at least 2 (got {}): compaction merges at least two layers", args.max_chain);
    }
    cfg.max_chain = args.max_chain;
    cfg.idmap.host_base = args.uid_base;
    cfg.store_url = args.store_url;
    cfg.store_credentials = store_credentials;
    cfg.metadata_url = args.metadata_url;
    cfg.store_key_file = args.store_key_file;
    cfg.volume_encryption = args.volume_encryption == "on";
    cfg.volume_key_file = args.volume_key_file;
    cfg.volume_fs_bytes = args.volume_fs_size_gb << 30;
    cfg.volume_cache_bytes = (args.volume_cache_mb > 0).then_some(args.volume_cache_mb << 20);
    cfg.port_bind = args.port_bind;
    if let Some(addr) = &args.listen {
        let port = addr.rsplit_once(':').map(|(_, p)| p).unwrap_or("");
        cfg.port_domain = Some(format!("{}:{port}", args.port_domain.trim_matches('.')));
    }
    let bridge_ok = |b: &str| {
        !b.is_empty() && b.len() <= 8 && b.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
    };
    if !bridge_ok(&args.net_bridge) {
        bail!("--net-bridge {:?}: give 1 to 8 letters, digits, '-' or '_' (veths are named after it)", args.net_bridge);
    }
    if args.net_range.prefix_len() > 29 || args.net_range.prefix_len() < 8 {
        bail!("--net-range {}: give a prefix from /8 to /29 (room for the bridge and sandboxes)", args.net_range);
    }
    cfg.net_bridge = args.net_bridge;
    cfg.net_range = args.net_range;
    cfg.net_dns = args.net_dns;
    cfg.proxy_port = args.proxy_port;
    cfg.proxy_credentials = args.proxy_credentials;
    cfg.proxy_ca = args.proxy_ca;
    cfg.timeout_pause_grace = Duration::from_secs(args.timeout_pause_grace);
    cfg.setns_key_file = args.setns_key_file;
    cfg.node_name = args.node_name;
    cfg.store_gc_grace = Duration::from_secs(args.store_gc_grace);
    // One daemon per state dir: a second one would re-run recovery over the first one's live
    // sandboxes. The lock is held (by this open fd) for the daemon's lifetime.
    std::fs::create_dir_all(&args.state_dir).with_context(|| format!("creating {}", args.state_dir.display()))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(args.state_dir.join("daemon.lock"))
        .context("opening the state dir's lock file")?;
    // SAFETY: flock on an fd we own, with integer flags.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "another branchboxd uses state dir {}: stop it first (`branchbox daemon stop`) or pick another --state-dir",
            args.state_dir.display()
        );
    }
    let rt = tokio::task::spawn_blocking(move || Runtime::open(cfg)).await?.context("opening the runtime")?;
    tracing::info!(state_dir = %args.state_dir.display(), sandboxes = rt.count(), "runtime ready");
    let _lock = lock;
    let default_pool = (args.pool_size > 0)
        .then(|| ("base".to_string(), bb_runtime::pool::Target { min: args.pool_size, max: 2 * args.pool_size }));
    rt.start_pool(default_pool).context("starting the warm pool")?;

    // TTL reaper.
    let reaper_rt = rt.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            reaper_rt.reap_expired().await;
        }
    });

    // Volume leases renewed; synced volumes uploaded in the background.
    let volume_rt = rt.clone();
    let upload_every = Duration::from_secs(args.volume_sync_interval);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(bb_runtime::volumes::LEASE_RENEW);
        let mut last_upload = std::time::Instant::now();
        loop {
            tick.tick().await;
            let upload = !upload_every.is_zero() && last_upload.elapsed() >= upload_every;
            if upload {
                last_upload = std::time::Instant::now();
            }
            volume_rt.volume_tick(upload).await;
        }
    });

    if let Some(dir) = args.socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if args.socket.exists() {
        if std::os::unix::net::UnixStream::connect(&args.socket).is_ok() {
            bail!(
                "another daemon is already serving on {}: stop it first (`branchbox daemon stop`)",
                args.socket.display()
            );
        }
        std::fs::remove_file(&args.socket)?;
    }
    let unix =
        tokio::net::UnixListener::bind(&args.socket).with_context(|| format!("binding {}", args.socket.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&args.socket, std::fs::Permissions::from_mode(0o660))?;
    }
    tracing::info!(socket = %args.socket.display(), "serving");
    let app = bb_api::router(rt.clone(), None);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = unix.accept().await else { continue };
            let svc = TowerToHyperService::new(app.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    if let Some(addr) = &args.listen {
        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, "serving on TCP (bearer token required)");
        let app =
            bb_api::with_port_hosts(bb_api::router(rt.clone(), args.token.clone()), rt.clone(), &args.port_domain);
        tokio::spawn(async move {
            let _ = axum::serve(tcp, app).await;
        });
    }

    if let Some(addr) = &args.e2b_listen {
        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, "serving the E2B-compatible endpoint (X-API-KEY = the token)");
        if !bb_e2b::key_looks_like_e2bs(args.token.as_deref().unwrap_or("")) {
            tracing::warn!(
                "the token is not of the form e2b_<hex>: some E2B SDK versions (e.g. e2b 2.44) refuse such API keys \
                 before sending them; use a token like e2b_$(openssl rand -hex 20) for those"
            );
        }
        let cfg = bb_e2b::E2bConfig {
            api_key: args.token.clone().unwrap_or_default(),
            domain: args.e2b_domain.trim_matches('.').to_string(),
        };
        let app = bb_e2b::router(rt.clone(), cfg);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = tcp.accept().await else { continue };
                let _ = stream.set_nodelay(true);
                let svc = TowerToHyperService::new(app.clone());
                // HTTP/1.1 and HTTP/2 without TLS (prior knowledge): E2B's SDKs speak HTTP/2.
                tokio::spawn(async move {
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    }

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
    // Pooled and nested fork shells belong to nobody (no record): tear them down, and let
    // nothing be pooled from here on (kills below are torn down, not recycled).
    rt.shutdown_pools(Duration::from_secs(10)).await;
    if args.kill_on_exit {
        rt.kill_all().await;
    }
    let _ = std::fs::remove_file(&args.socket);
    Ok(())
}
