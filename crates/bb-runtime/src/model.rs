//! Request and response types of the public API (serde + OpenAPI schemas).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Image name (default `base`).
    pub image: Option<String>,
    /// Start from this template (`branchbox template ls`): a live copy of its sessions, nested
    /// in the template's sandbox. Limits, env, cwd, metadata and timeout still apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Start from this snapshot (taken here, or pushed by any daemon sharing the object store
    /// and metadata store: pulled first): its files, and its sessions restored from their
    /// templates or process images. The snapshot's image and limits are kept; env, metadata and
    /// timeout of the request apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// CPUs (1.0 = one core).
    pub cpu: Option<f64>,
    pub memory_mb: Option<u64>,
    pub pids: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Seconds until the sandbox is killed (0 = never; default 300).
    pub timeout: Option<f64>,
    /// `none` (loopback only, the default), `allowlist` (only what `allow` lists) or `open`
    /// (anything but the host, the daemon, other sandboxes and link-local/metadata addresses).
    pub network: Option<String>,
    /// What the sandbox may reach: names (`api.example.com`), wildcards (`*.example.org`),
    /// IPv4 addresses or CIDRs, each with an optional `:port` or `:low-high`. In mode `open`,
    /// an address listed here is let through even where `open` refuses it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// The daemon's HTTP(S) proxy inside the sandbox at `127.0.0.1:3128` (`HTTP_PROXY` and
    /// `HTTPS_PROXY` in its environment), held to `allow` (mode `open`: any public address),
    /// adding the daemon's credentials for their hosts. In every mode: with `none` (and allow
    /// entries), the proxy is the sandbox's only way out. From a snapshot or a template: theirs
    /// unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<bool>,
    /// Record the proxy's answers to the sandbox's plaintext requests (plain HTTP, and HTTPS
    /// the proxy opens itself for a host with credentials), so that after a rollback, in a fork
    /// child or in a sandbox created from a snapshot the same requests, in the same order, get
    /// the same answers (deterministic replays for tree search). Needs `proxy`. Kept in the
    /// daemon's memory (lost at its restart). From a snapshot: theirs unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_record: Option<bool>,
    /// Caps on its traffic: `{"max_connections": 64, "bandwidth_mbps": 100}` (from a snapshot
    /// or a template: theirs unless given; fork children inherit them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_limits: Option<crate::net::policy::Limits>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// What happens at the timeout, and whether a paused sandbox wakes on use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
    /// Volumes to mount (`POST /v1/volumes`), each at its own path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// Let commands run as another user (`user`) use setuid programs such as `sudo` (the
    /// image's `/etc/sudoers` decides who may): their processes start without `no_new_privs`.
    /// They can become root of the sandbox's user namespace, what `user: "root"` gives, never
    /// root of the host; the seccomp filter and capability set stay. Default false (E2B's
    /// endpoint sets it: E2B's `user` has passwordless sudo). From a snapshot or a template:
    /// theirs unless given; fork children inherit it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sudo: Option<bool>,
}

/// What happens when a sandbox's timeout passes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The sandbox is killed (the default).
    #[default]
    Kill,
    /// The sandbox is paused: its processes are dumped to disk and freed; `resume` (or
    /// `connect`) brings them back.
    Pause,
}

/// What a pause keeps.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Files and processes (the default): every process is dumped to a process image and
    /// comes back at resume under its pid, with its memory. Needs CRIU.
    #[default]
    Full,
    /// Files only: every process but init is ended, nothing is dumped. The resume is a cold
    /// boot: no sessions, no background processes, a new boot id
    /// (`/proc/sys/kernel/random/boot_id`). Fast, small, and works without CRIU.
    Filesystem,
}

/// A sandbox's lifecycle settings (as E2B's `lifecycle`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Lifecycle {
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// A paused sandbox resumes by itself when a command, code, a file operation or a session
    /// request reaches it (only with `on_timeout: "pause"`).
    #[serde(default)]
    pub auto_resume: bool,
    /// What a pause at the timeout keeps (only with `on_timeout: "pause"`; `filesystem`
    /// cannot be combined with `auto_resume`).
    #[serde(default)]
    pub pause_mode: PauseMode,
}

/// What a sandbox was created with (persisted).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SandboxSpec {
    pub image: String,
    pub image_env: Vec<String>,
    pub layers: Vec<String>,
    pub cpu: f64,
    pub memory_mb: u64,
    pub pids: u64,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub network: String,
    /// The network's allow entries (see [`CreateSandbox::allow`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Port of the daemon's proxy inside the sandbox (None: no proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_port: Option<u16>,
    /// The proxy's answers are recorded (see [`CreateSandbox::proxy_record`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub proxy_record: bool,
    /// Caps on its traffic (see [`CreateSandbox::net_limits`]).
    #[serde(default, skip_serializing_if = "crate::net::policy::Limits::is_none")]
    pub net_limits: crate::net::policy::Limits,
    pub metadata: BTreeMap<String, String>,
    /// Seconds of life a sandbox gets at creation and at each resume (None: no limit).
    #[serde(default)]
    pub timeout: Option<f64>,
    #[serde(default)]
    pub lifecycle: Lifecycle,
    /// Setuid programs work for other users (see [`CreateSandbox::sudo`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sudo: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    pub id: String,
    pub image: String,
    /// `running`, `paused` or `dead`.
    pub state: String,
    pub created_at: f64,
    pub expires_at: Option<f64>,
    pub cpu: f64,
    pub memory_mb: u64,
    pub pids: u64,
    /// Its network mode now (`none`, `allowlist` or `open`; changed with
    /// `PUT /v1/sandboxes/{id}/network`).
    pub network: String,
    /// Its allow entries now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Its address on the sandboxes' bridge (modes with egress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The daemon's proxy as the sandbox reaches it (`http://127.0.0.1:3128`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<String>,
    /// Bytes the sandbox received and sent through its network interface (modes with egress;
    /// loopback and ports reached from the host are not counted).
    #[serde(default)]
    pub net_rx_bytes: u64,
    #[serde(default)]
    pub net_tx_bytes: u64,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub metadata: BTreeMap<String, String>,
    pub init_pid: i32,
    pub oom_killed: bool,
    pub memory_bytes: u64,
    pub pids_current: u64,
    pub lifecycle: Lifecycle,
    /// When the sandbox was paused (state `paused`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<f64>,
    /// Set on a fork child whose sessions are live copies: the sandbox whose namespaces it is
    /// nested in. It keeps running when that sandbox is killed, and that sandbox's processes can
    /// see its processes (as a parent process can see its children); see docs/ARCHITECTURE.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nested_in: Option<String>,
    /// Volumes mounted in the sandbox (by id).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// Setuid programs (`sudo`) work for its other users (see `CreateSandbox.sudo`).
    #[serde(default)]
    pub sudo: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    pub timeout: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommand {
    /// Shell command line, run with `/bin/sh -c`.
    pub cmd: Option<String>,
    /// argv, instead of `cmd`.
    pub args: Option<Vec<String>>,
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds (default 60; 0 = no limit).
    pub timeout: Option<f64>,
    pub stdin: Option<String>,
    pub stdin_b64: Option<String>,
    #[serde(default)]
    pub background: bool,
    /// Run as this user of the sandbox (its /etc/passwd; default root): its uid and gid, no
    /// supplementary groups, HOME/USER/LOGNAME set, and its home as the default cwd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CommandResult {
    pub pid: i32,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub oom_killed: bool,
    pub duration: f64,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Started {
    pub pid: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProcessInfo {
    pub pid: i32,
    pub cmd: String,
    pub running: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub started_at: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    pub timeout: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KillRequest {
    pub signal: Option<i32>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// `python` (default), `shell`, `javascript` (node in the image; a fork's or rollback's
    /// copy gets its global scope made again, not node's heap: see docs/E2B.md) or
    /// `typescript` (as `javascript`, each run compiled with the `typescript` package, which
    /// node must find).
    pub kind: Option<String>,
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SessionInfo {
    pub id: String,
    pub kind: String,
    pub pid: i32,
    pub created_at: f64,
    pub alive: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCode {
    pub code: String,
    pub timeout: Option<f64>,
    /// Only `python` (for `/code`).
    pub language: Option<String>,
    /// Environment variables set for this run only (python: `os.environ`; shell: exported),
    /// put back as they were when it ends. Names are shell identifiers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// Result of a session run: python (`result`, `error`) or shell (`exit_code`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct SessionResult {
    pub stdout: String,
    pub stderr: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub error: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    /// Python: rich outputs of the run, in order: `display(obj)` calls, matplotlib figures left
    /// open (as `png`, with their data as E2B's `chart` where it reads as one), then the last expression's when it has more than text
    /// (`is_main_result`; its text is `result`). Each holds `text` (its repr) and what the
    /// object offers of `html`, `markdown`, `svg`, `png`, `jpeg`, `pdf`, `latex`, `json`,
    /// `javascript` (binary ones base64).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub displays: Vec<serde_json::Value>,
    /// Python: how many runs the session has had, this one included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution_count: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EntryInfo {
    pub name: String,
    pub path: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    /// Owner and group, as ids inside the sandbox (65534 when outside its range).
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    pub mtime: f64,
    /// Last access and last status change (seconds since the epoch).
    #[serde(default)]
    pub atime: f64,
    #[serde(default)]
    pub ctime: f64,
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EntryList {
    pub entries: Vec<EntryInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MakeDir {
    pub path: String,
    #[serde(default = "yes")]
    pub parents: bool,
    /// The sandbox user new directories belong to (default root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Rename {
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ImageInfo {
    pub name: String,
    pub id: String,
    pub layers: Vec<String>,
    pub size_bytes: u64,
    pub created_at: f64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildImage {
    pub name: Option<String>,
    pub suite: Option<String>,
    pub packages: Option<Vec<String>>,
    pub mirror: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportImage {
    pub name: String,
    /// Path on the daemon's host of a `docker save` tarball or an OCI layout (dir or tar).
    pub path: String,
}

/// One line of an NDJSON progress stream.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProgressEvent {
    Progress { stage: String, done: Option<u64>, total: Option<u64>, message: String },
    Done { image: ImageInfo },
    Error { error: ErrorBody },
}

/// One line of a streamed command.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandEvent {
    Start { pid: i32 },
    Stdout { data: String },
    Stderr { data: String },
    Exit { pid: i32, exit_code: Option<i32>, signal: Option<i32>, timed_out: bool, oom_killed: bool, duration: f64 },
    Error { error: ErrorBody },
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    pub ok: bool,
    pub version: String,
    pub cgroup: String,
    pub sandboxes: usize,
    /// Process images (CRIU): whether they are on, and the disk they use.
    pub process_images: ProcessImageStats,
    /// Where pushed snapshots go (`--store-url`) and where they are recorded
    /// (`--metadata-url`), credentials left out.
    #[serde(default)]
    pub store: String,
    #[serde(default)]
    pub metadata: String,
}

/// What the daemon keeps as process images (see `GET /v1/health`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ProcessImageStats {
    /// CRIU's version, or null when process images are off.
    pub criu: Option<String>,
    /// Why process images are off (null when on).
    pub unavailable: Option<String>,
    pub images: u64,
    pub bytes: u64,
    pub limit_bytes: u64,
    /// Whether restores are lazy: processes run at once, their memory copied in after.
    #[serde(default)]
    pub lazy_pages: bool,
    /// Why restores read all memory up front (null when lazy).
    #[serde(default)]
    pub lazy_unavailable: Option<String>,
    /// Restored trees whose memory is still being copied in.
    #[serde(default)]
    pub lazy_serving: u64,
}

// ---- snapshots ----

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// Free-form label shown in snapshot listings.
    pub label: Option<String>,
    /// What of the processes the snapshot keeps: `sessions` (the default, the fast path),
    /// `all` (background processes too, as process images: a rollback to it restores them, and
    /// a fork of it or a sandbox created from it gets them), `keepable` (those of them CRIU
    /// can keep) or `none` (the files alone: what starts from it starts without sessions).
    #[serde(default)]
    pub processes: Processes,
}

/// Which processes a checkpoint keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Processes {
    /// Sessions only, as live templates (background processes are killed by a rollback).
    #[default]
    Sessions,
    /// Sessions, and every background process tree as a process image (needs CRIU). A tree
    /// that cannot be kept fails the checkpoint. Processes attached to the daemon (commands
    /// of the E2B endpoint, whose pipes or terminal it holds) are kept too: a restore gives
    /// them new ones there, which the daemon holds.
    All,
    /// As `all`, but a tree that cannot be kept (e.g. a socket CRIU cannot dump, a terminal of
    /// a shell that ended) is left out: the snapshot's `processes` lists those kept.
    Keepable,
    /// The files alone: no sessions, no processes (a rollback to it, a fork of it and a sandbox
    /// made from it start without sessions, as after a cold boot; they start afresh when used).
    None,
}

impl Processes {
    /// Whether background process trees are dumped.
    pub fn trees(self) -> bool {
        matches!(self, Processes::All | Processes::Keepable)
    }

    /// Whether sessions are kept (as templates).
    pub fn sessions(self) -> bool {
        self != Processes::None
    }
}

/// A background process a snapshot keeps in a process image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SnapshotProcessInfo {
    /// Its pid in the sandbox (it comes back with it).
    pub pid: i32,
    /// Its command, as `commands list` shows it.
    pub cmd: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// Snapshot id to return to.
    pub snapshot: String,
    /// Processes restored from process images (evicted session templates, `processes: "all"`
    /// trees) run before their memory is copied in, which then follows in the background
    /// (default: true where the daemon can, see `health.process_images.lazy_pages`). false: their
    /// memory is read in full before the rollback returns.
    #[serde(default)]
    pub lazy_pages: Option<bool>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Number of children (1..=64, default 1).
    pub count: Option<u32>,
    /// Snapshot to fork from (default: a checkpoint taken now).
    pub snapshot: Option<String>,
    /// TTL of the children in seconds (default: the daemon's default; 0 = none).
    pub timeout: Option<f64>,
    /// Independent children: their own top-level namespaces, so neither they nor the parent can
    /// see or signal each other's processes; their sessions start fresh. By default children
    /// get live copies of the sessions and are nested in the parent's namespaces: isolated from
    /// each other and unable to reach the parent, but visible to it (like a parent process's
    /// children). See docs/ARCHITECTURE.md.
    #[serde(default)]
    pub isolated: bool,
    /// The children's network mode (default: the parent's at the fork).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The children's allow entries (default: the parent's at the fork; given alone, with the
    /// parent's mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    /// The answers to the parent's proxied requests in flight at the fork's checkpoint are
    /// handed to every child: a child's first request that matches one (same method, URL and
    /// body; its copy of the parent's connection to the proxy is reset, so a client that
    /// retries sends it again) gets the parent's answer once it arrives instead of going
    /// upstream. Plaintext requests only (plain HTTP, and hosts the proxy adds credentials
    /// for); needs the sandbox's proxy and a checkpoint taken now (not `snapshot`).
    #[serde(default)]
    pub replay_inflight: bool,
    /// What of the processes the children get, for a checkpoint the fork takes now: `sessions`
    /// (the default), `none` (the files alone: no sessions) or `all`/`keepable` (background
    /// processes too, restored into each child from process images under their pids; needs CRIU). A named `snapshot` that kept
    /// background processes gives them to the children whatever this says.
    #[serde(default)]
    pub processes: Processes,
}

/// A new network policy for a running sandbox (`PUT /v1/sandboxes/{id}/network`): it applies to
/// connections made from then on.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkUpdate {
    /// `none`, `allowlist` or `open` (default: unchanged).
    pub network: Option<String>,
    /// The allow entries (default: unchanged; `[]` clears them).
    pub allow: Option<Vec<String>>,
    /// Caps on its traffic (default: unchanged; `{}` lifts them).
    pub limits: Option<crate::net::policy::Limits>,
}

/// A sandbox's network as it stands.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct NetworkInfo {
    pub sandbox: String,
    pub network: String,
    pub allow: Vec<String>,
    /// Its address on the sandboxes' bridge (modes with egress).
    pub address: Option<String>,
    /// The daemon's proxy as the sandbox reaches it, if it has one.
    pub proxy: Option<String>,
    /// Caps on its traffic.
    pub limits: crate::net::policy::Limits,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Snapshots to keep (with their ancestors).
    #[serde(default)]
    pub keep: Vec<String>,
    /// Only consider the snapshots taken in this sandbox (default: all).
    pub sandbox: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct SnapshotSessionInfo {
    pub id: String,
    pub kind: String,
    pub default: bool,
    /// A live template process holds this session's state.
    pub template: bool,
    /// A process image on disk holds it (restored on rollback or fork when no template lives).
    #[serde(default)]
    pub image: bool,
    /// Why neither does (rollback and fork start this session fresh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotInfo {
    pub id: String,
    /// Sandbox the snapshot was taken in.
    pub sandbox_id: String,
    pub parent: Option<String>,
    pub children: Vec<String>,
    pub created_at: f64,
    pub label: Option<String>,
    /// Bytes only this snapshot holds (its own layer); 0 when it shares its parent's state.
    pub size_bytes: u64,
    /// Snapshot layers under it (image layers not counted).
    pub depth: usize,
    /// Nothing changed since the previous snapshot: this one shares its state.
    pub lightweight: bool,
    pub sessions: Vec<SnapshotSessionInfo>,
    /// Background processes kept (`processes: "all"` checkpoints).
    #[serde(default)]
    pub processes: Vec<SnapshotProcessInfo>,
    /// `node-local` (on this node's disk) or `durable` (pushed: in the object store and the
    /// metadata store, it survives the loss of this node).
    #[serde(default = "node_local")]
    pub durability: String,
    /// How long the checkpoint took (only in the checkpoint response).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub took_ms: Option<f64>,
}

fn node_local() -> String {
    "node-local".into()
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RollbackResult {
    pub snapshot: String,
    /// Some session had neither a live template nor a process image and was started fresh.
    pub sessions_restarted: bool,
    /// The sessions started fresh, and why.
    #[serde(default)]
    pub restarted: Vec<RestartedSession>,
    /// Pids of the non-session processes that were killed.
    pub killed: Vec<i32>,
    /// Background processes the snapshot kept, restored (same pids).
    #[serde(default)]
    pub restored_processes: Vec<i32>,
    /// Background processes the snapshot kept that could not be restored, and why.
    #[serde(default)]
    pub processes_not_restored: Vec<String>,
    pub took_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkResult {
    pub snapshot: String,
    pub sandboxes: Vec<SandboxInfo>,
    /// The children's sessions were started fresh (not live copies).
    pub sessions_restarted: bool,
    /// Why, when they were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_reason: Option<String>,
    /// How many of the parent's proxied requests in flight were handed to the children
    /// (`replay_inflight`).
    #[serde(default)]
    pub inflight_handed: u32,
    /// Background processes of the snapshot that did not come back in a child, each with the
    /// child and why (the child runs on without them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes_not_restored: Vec<String>,
    pub took_ms: f64,
}

/// A session a rollback started fresh.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RestartedSession {
    pub session: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct GcResult {
    pub deleted: Vec<String>,
    pub freed_bytes: u64,
}

/// One image's pool.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct PoolImageStats {
    /// Ready sandboxes kept by the background refill.
    pub min: usize,
    /// Killed sandboxes are recycled while fewer than this are ready.
    pub max: usize,
    /// Ready now.
    pub ready: usize,
    /// Of those, wired ahead for creates with egress (their share follows the recent creates).
    #[serde(default)]
    pub wired: usize,
}

/// `GET /v1/pool`: the warm pool's configuration and counters since the daemon started.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct PoolStats {
    pub images: std::collections::BTreeMap<String, PoolImageStats>,
    /// Creates served from the pool.
    pub hits: u64,
    /// Creates that started cold (nothing ready).
    pub misses: u64,
    /// Killed sandboxes cleaned and returned to the pool.
    pub recycled: u64,
    /// Sandboxes built by the background refill.
    pub created: u64,
    /// Refill attempts that failed (see `last_error`); creates then start cold.
    pub failures: u64,
    pub last_error: Option<String>,
    /// Time to build one pooled sandbox (recent builds).
    pub refill_ms_p50: Option<f64>,
    pub refill_ms_p99: Option<f64>,
    /// How sandbox inits are put in their cgroups: `clone_into_cgroup` (cgroup v2: cloned
    /// straight into it) or `migrate` (cgroup v1: moved after clone), and the median time (ms)
    /// of recent placements (for clone_into_cgroup, of the whole clone).
    pub cgroup_placement: Option<String>,
    pub cgroup_placement_ms_p50: Option<f64>,
}

/// `PUT /v1/pool/{image}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPool {
    /// Ready sandboxes to keep (0 = none built in the background).
    pub min: usize,
    /// Recycle killed sandboxes while fewer are ready (default: `min`; 0 with min 0 = no pool).
    pub max: Option<usize>,
}

/// `POST /v1/templates`: a recipe.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplate {
    pub name: String,
    /// Image (default `base`).
    pub image: Option<String>,
    /// Shell commands run in order (`/bin/sh -c`); any non-zero exit fails the build.
    #[serde(default)]
    pub run: Vec<String>,
    /// Python code run in the default session, whose state the template keeps (e.g. imports).
    pub code: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub cpu: Option<f64>,
    pub memory_mb: Option<u64>,
    pub pids: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Seconds each command and the code may take (default 600).
    pub timeout: Option<f64>,
    /// Sandboxes kept ready to hand out (default 4).
    pub shells: Option<usize>,
    /// The network of the recipe's sandbox (its commands may need egress, e.g. `pip install`)
    /// and, by default, of the sandboxes created from the template: `none` (default),
    /// `allowlist` or `open` (see [`CreateSandbox::network`]).
    pub network: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// The daemon's proxy in the recipe's sandbox and the template's sandboxes (see
    /// [`CreateSandbox::proxy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<bool>,
    /// Volumes the recipe's sandbox mounts (it may fill them). Each sandbox created from the
    /// template gets a copy-on-write fork of each `branch` volume at the same path (`rox`
    /// volumes: the same volume, read-only); the template holds them until it is removed.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateInfo {
    pub name: String,
    pub image: String,
    /// The snapshot sandboxes are created from.
    pub snapshot: String,
    /// The template's own (hidden) sandbox.
    pub sandbox_id: String,
    pub created_at: f64,
    /// Sandboxes kept ready to hand out, and how many are ready now.
    pub shells: usize,
    pub ready_shells: usize,
    /// The frozen sessions are alive (otherwise sandboxes start with fresh sessions).
    pub alive: bool,
    /// Memory charged to the template's sandbox (the frozen sessions), bytes.
    pub memory_bytes: u64,
    /// The volumes the template holds: its sandboxes get forks of them (see `BuildTemplate`).
    pub volumes: Vec<VolumeMount>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<TemplateInfo>,
}

/// One line of a template build's NDJSON stream.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TemplateEvent {
    Progress { stage: String, message: String, done: Option<u64>, total: Option<u64> },
    Done { template: TemplateInfo },
    Error { error: ErrorBody },
}

/// `POST /v1/sandboxes/{id}/resume`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeSandbox {
    /// Seconds until the sandbox's timeout, from now (0 = no limit). Default: the timeout it was
    /// created with.
    pub timeout: Option<f64>,
    /// Cold-boot the sandbox instead of restoring its processes: it comes back with its files
    /// only (no sessions, no background processes, a new boot id), and the process images of
    /// a full pause are deleted. A sandbox paused with mode `filesystem` always resumes so.
    #[serde(default)]
    pub reboot: bool,
}

/// `POST /v1/sandboxes/{id}/pause`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseSandbox {
    /// Make the paused sandbox durable and free this node of it: its state (files, sessions,
    /// background processes) is checkpointed and pushed to the object store, recorded in the
    /// metadata store, and the sandbox leaves this daemon. Any daemon sharing both resumes it,
    /// under the same id (`resume`, or `connect`).
    #[serde(default)]
    pub push: bool,
    /// What the pause keeps: `full` (files and processes, the default) or `filesystem` (files
    /// only; the resume is a cold boot).
    #[serde(default)]
    pub mode: PauseMode,
}

/// A sandbox paused: its processes are in process images on disk, its memory is free.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PauseResult {
    pub sandbox: SandboxInfo,
    /// Process trees dumped (sessions, background commands, orphans).
    pub processes: usize,
    pub sessions: usize,
    /// Disk the process images take.
    pub image_bytes: u64,
    pub took_ms: f64,
    /// What the pause kept (`filesystem`: the resume is a cold boot).
    #[serde(default)]
    pub mode: PauseMode,
    /// `node-local` (kept on this node's disk) or `durable` (pushed: it outlives this node).
    #[serde(default = "node_local")]
    pub durability: String,
    /// With `push`: the snapshot that holds its state (any daemon resumes the sandbox from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// A snapshot's session templates moved out of memory into process images.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OffloadResult {
    pub snapshot: String,
    /// Templates that were in memory and were dumped now.
    pub offloaded: usize,
    /// The snapshot's sessions a process image holds (after this call).
    pub images: usize,
    pub image_bytes: u64,
    /// Sessions of the snapshot whose state is lost (never forked, or dropped), with why.
    pub lost: Vec<String>,
    pub took_ms: f64,
}

/// A sandbox resumed: its processes restored under the same pids, its sessions re-attached.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResumeResult {
    pub sandbox: SandboxInfo,
    /// Process trees restored.
    pub processes: usize,
    pub sessions: usize,
    pub took_ms: f64,
    /// The processes run before their memory was all copied in, which follows in the
    /// background (lazy pages; false: it was read in full first).
    #[serde(default)]
    pub lazy_pages: bool,
    /// The sandbox was cold-booted (a `filesystem` pause, or `reboot`): files only, a new boot id.
    #[serde(default)]
    pub rebooted: bool,
}

/// A snapshot made durable: its layers and process images in the object store, its record in
/// the metadata store (`durable`: it survives the loss of this node).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PushResult {
    pub snapshot: String,
    /// `durable` once pushed.
    pub durability: String,
    /// It was pushed before: nothing was uploaded.
    pub already: bool,
    /// Layers and process images uploaded now (the others were in the store already).
    pub layers_pushed: usize,
    pub images_pushed: usize,
    /// Bytes written to the object store (sealed, compressed), and file bytes read to make them.
    pub uploaded_bytes: u64,
    pub read_bytes: u64,
    /// Sessions whose state the snapshot does not hold (they start fresh where it is restored).
    pub lost: Vec<String>,
    pub took_ms: f64,
}

/// A pushed snapshot brought into this daemon's state (layers and images it lacked downloaded).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PullResult {
    pub snapshot: String,
    /// The snapshot was here already (taken or pulled before): nothing was downloaded.
    pub already: bool,
    pub layers_pulled: usize,
    pub images_pulled: usize,
    /// Bytes read from the object store (sealed, compressed).
    pub downloaded_bytes: u64,
    pub took_ms: f64,
}

/// A snapshot record in the metadata store (what `snapshot ls --remote` shows).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RemoteSnapshotInfo {
    pub id: String,
    /// Sandbox it was taken in (on the daemon that pushed it).
    pub sandbox_id: String,
    pub parent: Option<String>,
    pub label: Option<String>,
    pub created_at: f64,
    pub pushed_at: f64,
    /// The daemon that pushed it (`--node-name`).
    pub node: String,
    /// Image name of the sandbox it was taken in.
    pub image: String,
    pub sessions: Vec<String>,
    /// File bytes of its layers and process images.
    pub bytes: u64,
    /// This daemon has it (taken here, or pulled).
    pub local: bool,
}

/// A sandbox paused with `push` (`snapshot ls --remote` lists them): any daemon sharing the
/// stores resumes it under its id.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RemotePausedInfo {
    pub id: String,
    /// The snapshot holding its state.
    pub snapshot: String,
    pub image: String,
    pub paused_at: f64,
    /// The daemon that paused it.
    pub node: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RemoteSnapshotList {
    pub snapshots: Vec<RemoteSnapshotInfo>,
    /// Sandboxes paused with `push`, waiting to be resumed on any daemon.
    #[serde(default)]
    pub paused: Vec<RemotePausedInfo>,
    /// The object store and the metadata store (credentials left out).
    pub store: String,
    pub metadata: String,
}

/// `POST /v1/remote/gc`: collect objects of the object store that no snapshot record reaches.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreGcRequest {
    /// Objects younger than this many seconds are kept even when unreachable (an upload in
    /// flight on another daemon). Default: the daemon's `--store-gc-grace`.
    pub grace_seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StoreGcResult {
    /// Objects in the store before, and those reached from a record.
    pub objects: usize,
    pub reachable: usize,
    /// Unreachable objects deleted, and their bytes.
    pub deleted: usize,
    pub deleted_bytes: u64,
    /// Unreachable objects kept because they are younger than the grace period.
    pub young: usize,
    pub took_ms: f64,
}

/// Who may mount a volume: `rwo` (one sandbox at a time, read-write or read-only; it branches
/// with that sandbox), `rox` (any number of sandboxes, read-only; written through the file API
/// while no sandbox mounts it) or `rwx` (any number of sandboxes of this daemon, read-write, all
/// seeing one copy: shared storage that never branches).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    #[default]
    Rwo,
    Rox,
    Rwx,
}

impl Access {
    /// Mounted by any number of sandboxes at once, one copy for all: fork children, rollbacks
    /// and checkpoints leave it as it is (it never branches).
    pub fn shared(self) -> bool {
        matches!(self, Access::Rox | Access::Rwx)
    }

    /// Sandboxes may write it: one node at a time does (the writer lease of a synced volume).
    pub fn writable(self) -> bool {
        matches!(self, Access::Rwo | Access::Rwx)
    }
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// Unique name (letters, digits, `-`, `_`, `.`; at most 63); the API accepts it wherever
    /// it takes the volume's id.
    pub name: Option<String>,
    #[serde(default)]
    pub access: Access,
    /// Most MiB the volume may hold on a node (its layers and its writable layer): file API
    /// writes beyond it are refused (507 `quota_exceeded`). Not yet enforced on writes from
    /// inside a sandbox.
    pub quota_mb: Option<u64>,
}

/// A volume mounted in a sandbox (in `CreateSandbox.volumes` and `SandboxInfo.volumes`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// Volume id or name.
    pub volume: String,
    /// Absolute path in the sandbox (created if missing; not `/`, `/proc`, `/dev` or `/sys`).
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
    /// The volume branches with the sandbox: a checkpoint snapshots it, a rollback restores it,
    /// a fork gives each child a copy-on-write fork of it. False for a shared cache.
    #[serde(default = "yes")]
    pub branch: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeInfo {
    pub id: String,
    pub name: Option<String>,
    pub access: Access,
    pub quota_mb: Option<u64>,
    pub created_at: f64,
    /// Bytes on this node's disk: the writable layer (measured now) and frozen layers (measured
    /// in the background after a freeze; until then a layer counts its last measured size).
    pub size_bytes: u64,
    /// Frozen layers under the writable one.
    pub layers: usize,
    pub snapshots: usize,
    pub mounts: Vec<VolumeMountInfo>,
    /// Version of the volume's committed head in the metadata store (0: never synced).
    pub version: i64,
    /// `durable` when everything is in the object store (nothing written since the last sync),
    /// else `node-local` (on this node's disk; an fsync'd write survives a daemon or node
    /// restart, not the loss of the node).
    pub durability: String,
    /// Bytes written since the last sync: what `sync` would upload at most.
    pub backlog_bytes: u64,
    /// The volume this one was forked from.
    pub source: Option<String>,
    /// Its layers on this node are on the daemon's encrypted filesystem (false: with
    /// `--volume-encryption off`, or layers made before the daemon encrypted volumes).
    pub encrypted_at_rest: bool,
    /// All of its layers are on this node. False: the node let some go from its bounded cache
    /// (`--volume-cache-mb`; the volume was durable and idle) and pulls them back from the
    /// object store when it is next mounted or read.
    pub cached: bool,
}

/// Where a volume is mounted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct VolumeMountInfo {
    pub sandbox: String,
    pub path: String,
    pub read_only: bool,
    pub branch: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeList {
    pub volumes: Vec<VolumeInfo>,
}

/// `POST /v1/volumes/{vid}/snapshots`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeSnapshotRequest {
    pub label: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeSnapshotInfo {
    pub id: String,
    pub volume: String,
    pub created_at: f64,
    pub label: Option<String>,
    /// Frozen layers the snapshot stands on.
    pub layers: usize,
    /// In the volume's committed head: restorable on any daemon sharing the stores (a volume's
    /// own snapshots become durable at its next sync; those of sandbox checkpoints stay local).
    pub durable: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VolumeSnapshotList {
    pub snapshots: Vec<VolumeSnapshotInfo>,
}

/// `POST /v1/volumes/{vid}/restore`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreVolume {
    pub snapshot: String,
}

/// `POST /v1/volumes/{vid}/fork`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkVolume {
    pub name: Option<String>,
    /// Fork this snapshot of the volume instead of its current state.
    pub snapshot: Option<String>,
}

/// A server port of a sandbox reached from the host (`GET /v1/sandboxes/{id}/ports/{port}`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PortInfo {
    pub sandbox: String,
    /// The port inside the sandbox (its loopback or any address it listens on).
    pub port: u16,
    /// `address:port` on the host whose connections reach it (`--port-bind`, 127.0.0.1).
    pub host: String,
    /// `http://` + `host`.
    pub url: String,
    /// The same port through the daemon's TCP listener (`--listen`), by Host header:
    /// `{port}-{sandbox}.{domain}:{listen port}` (`--port-domain`); left out without a listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_host: Option<String>,
    pub opened_at: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PortList {
    /// By port.
    pub ports: Vec<PortInfo>,
}

#[cfg(test)]
mod tests {
    use super::{Access, ForkRequest, ForkResult, Processes};

    #[test]
    fn processes_parse_and_say_whether_trees_are_dumped() {
        let parsed: Vec<Processes> = serde_json::from_str(r#"["sessions", "all", "keepable", "none"]"#).unwrap();
        assert_eq!(parsed, [Processes::Sessions, Processes::All, Processes::Keepable, Processes::None]);
        assert_eq!(parsed.iter().map(|p| p.trees()).collect::<Vec<_>>(), [false, true, true, false]);
        assert_eq!(parsed.iter().map(|p| p.sessions()).collect::<Vec<_>>(), [true, true, true, false]);
        assert!(serde_json::from_str::<Processes>(r#""some""#).is_err());
        // A fork asks for none unless told; its answer lists no failures when there are none.
        let req: ForkRequest = serde_json::from_str(r#"{"count": 2}"#).unwrap();
        assert_eq!(req.processes, Processes::Sessions);
        let req: ForkRequest = serde_json::from_str(r#"{"processes": "keepable"}"#).unwrap();
        assert_eq!(req.processes, Processes::Keepable);
        let answer = ForkResult {
            snapshot: "sn-1".into(),
            sandboxes: Vec::new(),
            sessions_restarted: false,
            restart_reason: None,
            inflight_handed: 0,
            processes_not_restored: Vec::new(),
            took_ms: 1.0,
        };
        assert!(!serde_json::to_string(&answer).unwrap().contains("processes_not_restored"));
    }

    #[test]
    fn access_modes_parse_and_say_who_shares_and_who_writes() {
        let parsed: Vec<Access> = serde_json::from_str(r#"["rwo", "rox", "rwx"]"#).unwrap();
        assert_eq!(parsed, [Access::Rwo, Access::Rox, Access::Rwx]);
        assert_eq!(serde_json::to_string(&Access::Rwx).unwrap(), r#""rwx""#);
        assert!(serde_json::from_str::<Access>(r#""rw""#).is_err());
        let shared: Vec<bool> = parsed.iter().map(|a| a.shared()).collect();
        let writable: Vec<bool> = parsed.iter().map(|a| a.writable()).collect();
        assert_eq!(shared, [false, true, true]);
        assert_eq!(writable, [true, false, true]);
    }
}
