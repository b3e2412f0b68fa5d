//! Sandbox networking (issue 18): egress by mode and allowlist ([`fabric`], [`dns`],
//! [`policy`]), and ports, a server inside a sandbox reached from the host ([`ports`]), in
//! every mode.
//!
//! A sandbox in mode `none` has only `lo` (init brings it up in the sandbox's own network
//! namespace). One in `allowlist` or `open` also gets `eth0`, wired by the daemon from the
//! outside once its init runs: a slot of `--net-range` (its address), a veth into the daemon's
//! bridge, and a chain of nftables rules ([`fabric`]). The bridge, the table and the DNS
//! server come up with the first such sandbox. The policy of each wired sandbox lives here
//! (and in table `networks` of the state database, for a daemon restart); the sandbox holds a
//! copy for its `info`. A policy change rewires nothing but the rules; going to or from
//! `none` adds or removes the veth. Pause, resume and rollback keep the sandbox's init, hence
//! its namespace, address and rules; a fork child is a new sandbox wired by the policy its
//! snapshot recorded (or the fork's own), on its own slot.

pub mod dns;
pub mod fabric;
pub mod inflight;
pub mod link;
pub mod nftset;
pub mod policy;
pub mod ports;
pub mod proxy;
pub mod record;

use crate::db::{self, DbError};
use crate::error::{ErrorKind, Result, RuntimeError};
use crate::model::{NetworkInfo, NetworkUpdate, SandboxSpec};
use crate::sandbox::Sandbox;
use crate::{Runtime, RuntimeConfig};
use fabric::{Fabric, FabricError};
use parking_lot::Mutex;
use policy::{Mode, Policy, PolicyError};
use rusqlite::{params, Connection};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NetError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("network: {0}")]
    Fabric(#[from] FabricError),
    #[error("every address of --net-range {0} is taken: give the daemon a larger range")]
    Full(ipnet::Ipv4Net),
    #[error("network: the daemon's DNS for sandboxes cannot listen on {addr}: {source}")]
    Dns {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("sandbox {0} has no network interface to change the rules of")]
    NotWired(String),
    #[error("proxy: {0}")]
    Proxy(#[from] proxy::ProxyError),
}

impl NetError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            NetError::Policy(_) => ErrorKind::BadRequest,
            NetError::Full(_) => ErrorKind::Unavailable,
            NetError::Proxy(proxy::ProxyError::Credentials { .. } | proxy::ProxyError::Ca { .. }) => {
                ErrorKind::BadRequest
            }
            _ => ErrorKind::Internal,
        }
    }
}

impl From<rusqlite::Error> for NetError {
    fn from(e: rusqlite::Error) -> Self {
        NetError::Db(e.into())
    }
}

/// A sandbox's network now: its policy (the proxy's too), and its wiring when it has egress.
#[derive(Debug, Clone, PartialEq)]
pub struct NetState {
    pub policy: Policy,
    pub wired: Option<Wired>,
}

impl Default for NetState {
    fn default() -> Self {
        NetState { policy: Policy::none(), wired: None }
    }
}

/// A sandbox wired to the bridge.
#[derive(Debug, Clone, PartialEq)]
pub struct Wired {
    pub slot: u32,
    pub address: Ipv4Addr,
    /// Its veth's host side (its byte counters are the sandbox's, the other way round).
    pub host_if: String,
    pub policy: Policy,
}

impl Wired {
    /// Bytes (received, sent) by the sandbox.
    pub fn counters(&self) -> (u64, u64) {
        fabric::counters(&self.host_if)
    }
}

/// What [`Runtime::net_wire`] made for a sandbox about to be registered.
pub(crate) struct NetWiring {
    state: NetState,
    proxy: Option<proxy::Listening>,
}

/// The bridge, the slots in use and their policies.
pub struct Net {
    pub(crate) fabric: Fabric,
    pub(crate) dns_upstream: Option<SocketAddr>,
    /// The HTTP(S) proxy of the sandboxes that asked for it.
    pub(crate) proxy: Arc<proxy::Proxy>,
    /// The bridge and table are up and the DNS serves (brought up on first use).
    up: Mutex<bool>,
    /// Wired sandboxes by id.
    wired: Mutex<HashMap<String, Wired>>,
    /// The slot handed out last.
    cursor: Mutex<u32>,
    /// Slots whose chains are made ahead of their sandboxes.
    ahead: Mutex<Ahead>,
    db: Mutex<Connection>,
}

/// Slots taken off the free ones for chains made ahead ([`fabric::Fabric::prepare`]).
#[derive(Default)]
struct Ahead {
    /// Their chains are made: handed out first.
    ready: VecDeque<u32>,
    /// Being made (a thread runs `nft`), or ready.
    reserved: BTreeSet<u32>,
}

/// How many slots have their chains made ahead at most.
const AHEAD: usize = 8;

/// The first nameserver of the host's resolv.conf, port 53.
fn host_nameserver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next()?.parse::<std::net::IpAddr>().ok()).flatten()
        })
        .map(|ip| SocketAddr::new(ip, 53))
}

impl Net {
    pub fn open(cfg: &RuntimeConfig, db: &Path) -> std::result::Result<Net, NetError> {
        let conn = db::open(db)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS networks (
                id TEXT PRIMARY KEY,
                slot INTEGER NOT NULL,
                mode TEXT NOT NULL,
                allow TEXT NOT NULL,
                limits TEXT NOT NULL DEFAULT '{}'
            );",
        )?;
        // A table made before limits existed.
        if conn.prepare("SELECT limits FROM networks LIMIT 0").is_err() {
            conn.execute_batch("ALTER TABLE networks ADD COLUMN limits TEXT NOT NULL DEFAULT '{}'")?;
        }
        let dns_upstream = cfg.net_dns.or_else(host_nameserver);
        let credentials = match &cfg.proxy_credentials {
            Some(path) => proxy::load_credentials(path)?,
            None => HashMap::new(),
        };
        let proxy =
            proxy::Proxy::new(cfg.proxy_port, credentials, cfg.proxy_ca.as_deref(), cfg.net_range, dns_upstream)?;
        Ok(Net {
            fabric: Fabric::new(&cfg.net_bridge, cfg.net_range),
            dns_upstream,
            proxy: Arc::new(proxy),
            up: Mutex::new(false),
            wired: Default::default(),
            cursor: Mutex::new(1),
            ahead: Default::default(),
            db: Mutex::new(conn),
        })
    }

    /// Bring the bridge, the table and the DNS up (once). Blocking; needs the tokio runtime.
    fn ensure_up(self: &Arc<Self>) -> std::result::Result<(), NetError> {
        let mut up = self.up.lock();
        if *up {
            return Ok(());
        }
        self.fabric.up()?;
        let addr = SocketAddr::new(self.fabric.gateway().into(), 53);
        let dns_err = |source| NetError::Dns { addr, source };
        let sock = std::net::UdpSocket::bind(addr).map_err(dns_err)?;
        sock.set_nonblocking(true).map_err(dns_err)?;
        let handle =
            tokio::runtime::Handle::try_current().map_err(|e| dns_err(std::io::Error::other(e.to_string())))?;
        let _guard = handle.enter();
        let sock = tokio::net::UdpSocket::from_std(sock).map_err(dns_err)?;
        handle.spawn(dns::serve(self.clone(), sock));
        if self.dns_upstream.is_none() {
            tracing::warn!("no nameserver in /etc/resolv.conf and no --net-dns: sandboxes' names will not resolve");
        }
        tracing::info!(bridge = %self.fabric.bridge, range = %self.fabric.range, dns = ?self.dns_upstream, "sandbox network up");
        *up = true;
        Ok(())
    }

    fn wired_at(&self, slot: u32, policy: Policy) -> Wired {
        Wired { slot, address: self.fabric.address(slot), host_if: self.fabric.host_if(slot), policy }
    }

    /// The slot and policy of the sandbox at `ip`.
    pub(crate) fn policy_at(&self, ip: Ipv4Addr) -> Option<(u32, Policy)> {
        self.wired.lock().values().find(|w| w.address == ip).map(|w| (w.slot, w.policy.clone()))
    }

    pub(crate) fn wired(&self, id: &str) -> Option<Wired> {
        self.wired.lock().get(id).cloned()
    }

    /// Record sandbox `id`'s `policy` on `slot` (0: unwired) for a daemon restart.
    fn save(&self, id: &str, slot: u32, policy: &Policy) -> std::result::Result<(), NetError> {
        let allow = serde_json::to_string(&policy.allow).expect("strings serialise");
        let limits = serde_json::to_string(&policy.limits).expect("limits serialise");
        self.db.lock().execute(
            "INSERT OR REPLACE INTO networks (id, slot, mode, allow, limits) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, slot, policy.mode.as_str(), allow, limits],
        )?;
        Ok(())
    }

    /// The next free slot round the range from the one handed out last (which it becomes):
    /// not lowest first, so that an address comes back to another sandbox as late as can be
    /// (after its conntrack entries and any DNS answer still on its way to the old holder's set
    /// are long gone).
    fn next_free(&self, wired: &HashMap<String, Wired>, ahead: &Ahead) -> Option<u32> {
        let used: BTreeSet<u32> = wired.values().map(|w| w.slot).collect();
        let (n, mut cursor) = (self.fabric.slots(), self.cursor.lock());
        let slot =
            (1..=n).map(|i| 2 + (*cursor + i - 2) % n).find(|s| !used.contains(s) && !ahead.reserved.contains(s))?;
        *cursor = slot;
        Some(slot)
    }

    /// Make chains ahead for up to [`AHEAD`] free slots (at most a quarter of the range), on a
    /// thread of its own; one batch at a time.
    fn prepare_ahead(self: &Arc<Self>) {
        let slots = {
            let wired = self.wired.lock();
            let mut ahead = self.ahead.lock();
            if ahead.reserved.len() > ahead.ready.len() {
                return; // a batch is being made
            }
            let want = AHEAD.min(self.fabric.slots() as usize / 4).saturating_sub(ahead.ready.len());
            let mut slots = Vec::new();
            while slots.len() < want {
                let Some(s) = self.next_free(&wired, &ahead) else { break };
                ahead.reserved.insert(s);
                slots.push(s);
            }
            slots
        };
        if slots.is_empty() {
            return;
        }
        let net = self.clone();
        let made = std::thread::Builder::new().name("bb-net-ahead".into()).spawn(move || {
            let done = net.fabric.prepare(&slots);
            let mut ahead = net.ahead.lock();
            match done {
                Ok(()) => ahead.ready.extend(slots),
                Err(e) => {
                    tracing::warn!("making sandboxes' rules ahead: {e}");
                    for s in slots {
                        ahead.reserved.remove(&s);
                    }
                }
            }
        });
        if let Err(e) = made {
            tracing::warn!("making sandboxes' rules ahead: {e}");
        }
    }

    /// Wire sandbox `id` (init `pid`) with `policy` on a free slot, one whose chain is made
    /// ahead first. Blocking.
    pub(crate) fn attach(self: &Arc<Self>, id: &str, pid: i32, policy: Policy) -> std::result::Result<Wired, NetError> {
        self.ensure_up()?;
        // The slot is taken under the lock and wired outside it (nothing else uses it meanwhile).
        let (slot, prepared) = {
            let mut wired = self.wired.lock();
            let mut ahead = self.ahead.lock();
            let taken = match ahead.ready.pop_front() {
                Some(s) => {
                    ahead.reserved.remove(&s);
                    (s, true)
                }
                None => (self.next_free(&wired, &ahead).ok_or(NetError::Full(self.fabric.range))?, false),
            };
            wired.insert(id.to_string(), self.wired_at(taken.0, Policy::none()));
            taken
        };
        let w = self.wired_at(slot, policy);
        let done = self.fabric.attach(slot, pid, &w.policy, prepared).map_err(NetError::from).and_then(|()| {
            self.save(id, slot, &w.policy).inspect_err(|_| {
                let _ = self.fabric.detach(slot);
            })
        });
        // Once wired: its `nft` would compete with this sandbox's wiring for the CPU.
        self.prepare_ahead();
        match done {
            Ok(()) => {
                self.wired.lock().insert(id.to_string(), w.clone());
                Ok(w)
            }
            Err(e) => {
                self.wired.lock().remove(id);
                Err(e)
            }
        }
    }

    /// Wire warm-pool shell `id` (init `pid`) ahead of its claim, in the [`fabric::parked`]
    /// shape: its veth, address and route, and a chain that lets nothing through (its DNS
    /// answers no name). A claim with egress then only sets the rules
    /// ([`Net::claim_prewired`]). Blocking.
    pub(crate) fn prewire(self: &Arc<Self>, id: &str, pid: i32) -> std::result::Result<Wired, NetError> {
        self.attach(id, pid, fabric::parked())
    }

    /// Give sandbox `id` (init `pid`), wired ahead by [`Net::prewire`], `policy` (with egress):
    /// its address entries or chain, and its bandwidth. Blocking.
    pub(crate) fn claim_prewired(&self, id: &str, pid: i32, policy: Policy) -> std::result::Result<Wired, NetError> {
        let Some(mut w) = self.wired(id) else { return Err(NetError::NotWired(id.to_string())) };
        debug_assert_eq!(w.policy, fabric::parked());
        self.fabric.assign(w.slot, pid, &policy)?;
        w.policy = policy;
        self.save(id, w.slot, &w.policy)?;
        self.wired.lock().insert(id.to_string(), w.clone());
        Ok(w)
    }

    /// Give wired sandbox `id` (init `pid`) `policy` (both with egress). Blocking.
    pub(crate) fn update(&self, id: &str, pid: i32, policy: Policy) -> std::result::Result<Wired, NetError> {
        let Some(mut w) = self.wired(id) else { return Err(NetError::NotWired(id.to_string())) };
        self.fabric.update(w.slot, &policy, &w.policy)?;
        if policy.limits.bandwidth_mbps != w.policy.limits.bandwidth_mbps {
            self.fabric.shape(w.slot, pid, &policy.limits)?;
        }
        w.policy = policy;
        self.save(id, w.slot, &w.policy)?;
        self.wired.lock().insert(id.to_string(), w.clone());
        Ok(w)
    }

    /// Record the policy of sandbox `id`, unwired (mode none with the proxy's entries), for a
    /// daemon restart.
    pub(crate) fn save_unwired(&self, id: &str, policy: &Policy) -> std::result::Result<(), NetError> {
        self.save(id, 0, policy)
    }

    /// Unwire sandbox `id`, if it is wired, and forget its record. Blocking.
    pub(crate) fn detach(&self, id: &str) {
        let _ = self.db.lock().execute("DELETE FROM networks WHERE id = ?1", params![id]);
        let Some(w) = self.wired.lock().remove(id) else { return };
        if let Err(e) = self.fabric.detach(w.slot) {
            tracing::warn!(%id, "removing the sandbox's network: {e}");
        }
    }

    /// After a daemon restart: the rules of every live wired sandbox again (their veths lived
    /// on with their inits); the records of the others go. Returns the networks recorded (the
    /// wired ones, and the policies changed on unwired sandboxes with the proxy).
    pub(crate) fn recover(self: &Arc<Self>, live: &HashMap<String, Arc<Sandbox>>) -> Vec<(String, NetState)> {
        let rows: Vec<(String, u32, String, String, String)> = {
            let db = self.db.lock();
            let mut stmt = match db.prepare("SELECT id, slot, mode, allow, limits FROM networks") {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("reading sandbox networks: {e}");
                    return Vec::new();
                }
            };
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)));
            rows.map(|it| it.filter_map(|r| r.ok()).collect()).unwrap_or_default()
        };
        let mut out = Vec::new();
        for (id, slot, mode, allow, limits) in rows {
            let limits = serde_json::from_str(&limits).unwrap_or_default();
            let policy = serde_json::from_str::<Vec<String>>(&allow)
                .ok()
                .and_then(|a| Policy::parse_for(&mode, &a, slot == 0).and_then(|p| p.with_limits(limits)).ok());
            let restored = match (live.contains_key(&id), policy) {
                (true, Some(policy)) if slot == 0 => Ok(NetState { policy, wired: None }),
                (true, Some(policy)) => self.ensure_up().and_then(|()| {
                    self.fabric.restore(slot, &policy)?;
                    Ok(NetState { wired: Some(self.wired_at(slot, policy.clone())), policy })
                }),
                _ => Err(NetError::Policy(PolicyError::Mode(mode.clone()))),
            };
            match restored {
                Ok(state) => {
                    if let Some(w) = &state.wired {
                        self.wired.lock().insert(id.clone(), w.clone());
                    }
                    out.push((id, state));
                }
                Err(e) => {
                    if live.contains_key(&id) {
                        tracing::warn!(%id, "the sandbox's network could not be restored ({e}); it has none now");
                    }
                    if slot != 0 {
                        let _ = self.fabric.detach(slot);
                    }
                    let _ = self.db.lock().execute("DELETE FROM networks WHERE id = ?1", params![id]);
                }
            }
        }
        out
    }
}

impl Runtime {
    /// The policy a sandbox is created with.
    pub(crate) fn spec_policy(spec: &SandboxSpec) -> Result<Policy> {
        Ok(Policy::parse_for(&spec.network, &spec.allow, spec.proxy_port.is_some())
            .and_then(|p| p.with_limits(spec.net_limits))
            .map_err(NetError::from)?)
    }

    /// Wire a new sandbox (init `pid`, root at `rootfs` on the host) whose spec asks for
    /// egress. Blocking.
    pub(crate) fn net_wire(&self, id: &str, pid: i32, rootfs: &Path, spec: &SandboxSpec) -> Result<NetWiring> {
        let policy = Self::spec_policy(spec)?;
        // A warm-pool or fork shell may have been wired ahead ([`Net::prewire`]).
        let prewired = self.net.wired(id).is_some();
        let wired = match (policy.mode, prewired) {
            (Mode::None, false) => None,
            (Mode::None, true) => {
                self.net.detach(id);
                None
            }
            (_, true) => {
                // A fork shell's root is the snapshot's now: it may lack the resolver.
                let w = std::thread::scope(|scope| {
                    scope.spawn(|| self.ensure_resolver(id, rootfs));
                    self.net.claim_prewired(id, pid, policy.clone()).inspect_err(|_| self.net.detach(id))
                })?;
                Some(w)
            }
            (_, false) => {
                // Independent: the resolver is written while the links and rules are made.
                let w = std::thread::scope(|scope| {
                    scope.spawn(|| self.ensure_resolver(id, rootfs));
                    self.net.attach(id, pid, policy.clone())
                })?;
                Some(w)
            }
        };
        let proxy = match spec.proxy_port.map(|port| self.net.proxy.listen(id, pid, port)).transpose() {
            Ok(p) => p,
            Err(e) => {
                self.net.detach(id);
                return Err(NetError::from(e).into());
            }
        };
        Ok(NetWiring { state: NetState { policy, wired }, proxy })
    }

    /// A sandbox just registered: its network from `wiring`, its proxy served.
    pub(crate) fn net_start(&self, sb: &Arc<Sandbox>, wiring: NetWiring) {
        *sb.net.lock() = wiring.state;
        if let Some(l) = wiring.proxy {
            self.net.proxy.serve(l, sb);
        }
    }

    /// After a daemon restart: sandbox `sb`'s network (`recorded` by [`Net::recover`]; none:
    /// mode none, with the proxy's entries as created) and its proxy again.
    pub(crate) fn net_recover(&self, sb: &Arc<Sandbox>, recorded: Option<NetState>) {
        *sb.net.lock() = recorded.unwrap_or_else(|| NetState {
            policy: Self::spec_policy(&sb.spec)
                .ok()
                .filter(|_| sb.spec.proxy_port.is_some())
                .map(|p| Policy { mode: Mode::None, ..p })
                .unwrap_or_else(Policy::none),
            wired: None,
        });
        if sb.spec.proxy_record {
            // The records were the old daemon's: nothing is replayed.
            self.net.proxy.recorder.start(&sb.id, None);
        }
        if let Some(port) = sb.spec.proxy_port.filter(|_| !sb.is_dead()) {
            match self.net.proxy.listen(&sb.id, sb.init_pid, port) {
                Ok(l) => self.net.proxy.serve(l, sb),
                Err(e) => tracing::warn!(sandbox = %sb.id, "the sandbox's proxy could not listen again: {e}"),
            }
        }
    }

    /// Give a wired sandbox's root an /etc/resolv.conf naming a nameserver if it has none
    /// (images often have none: a container runtime provides it). Any address would do (every
    /// DNS packet from the bridge reaches the daemon's DNS); the gateway's is written. Leaves a
    /// file that names one alone. Blocking; a failure is logged (names then do not resolve).
    pub(crate) fn ensure_resolver(&self, id: &str, rootfs: &Path) {
        use crate::sandbox::files::{SandboxFs, SbPath};
        use std::io::{Read, Write};
        let gw = self.net.fabric.gateway();
        let done = (|| -> Result<()> {
            let fs = SandboxFs::open(rootfs, self.cfg.idmap.host_base)?;
            let path = SbPath::parse("/etc/resolv.conf")?;
            let mut text = String::new();
            if let Ok((mut f, _)) = fs.open_read(&path) {
                let _ = f.read_to_string(&mut text);
            }
            let names_one = text.lines().any(|l| {
                let mut w = l.split_whitespace();
                w.next() == Some("nameserver")
                    && w.next().and_then(|a| a.parse::<std::net::IpAddr>().ok()).is_some_and(|a| !a.is_loopback())
            });
            if names_one {
                return Ok(());
            }
            let mut up = fs.begin_write(&path, Some(0o644))?;
            up.file()
                .write_all(format!("nameserver {gw}\n").as_bytes())
                .map_err(RuntimeError::io("write /etc/resolv.conf"))?;
            // Not synced: written again at every wiring, if lost.
            fs.commit_with(up, false)?;
            Ok(())
        })();
        if let Err(e) = done {
            tracing::warn!(%id, "could not write the sandbox's /etc/resolv.conf (names will not resolve): {e}");
        }
    }

    /// `sb`'s spec with its network as it is now (what a checkpoint records, so that its fork
    /// children get the policy the sandbox had then).
    pub(crate) fn spec_now(&self, sb: &Sandbox) -> SandboxSpec {
        let mut spec = sb.spec.clone();
        let net = sb.net.lock();
        spec.network = net.policy.mode.as_str().to_string();
        spec.allow = net.policy.allow.clone();
        spec.net_limits = net.policy.limits;
        spec
    }

    pub fn network(&self, id: &str) -> Result<NetworkInfo> {
        Ok(network_info(&*self.get(id)?))
    }

    /// Change a sandbox's network policy; connections made from then on follow it.
    pub async fn update_network(self: &Arc<Self>, id: &str, req: NetworkUpdate) -> Result<NetworkInfo> {
        let sb = self.get(id)?;
        if sb.is_dead() {
            return Err(RuntimeError::Conflict(format!("sandbox {id} is dead: kill it and create a new one")));
        }
        let rt = self.clone();
        tokio::task::spawn_blocking(move || -> Result<NetworkInfo> {
            // One change of a sandbox's network at a time.
            let _one = rt.net_changes.lock();
            let now = rt.spec_now(&sb);
            let mode = req.network.unwrap_or(now.network);
            let proxied = sb.spec.proxy_port.is_some();
            // Entries left out are kept, but for a change to none without the proxy.
            let allow = req.allow.unwrap_or(if mode == "none" && !proxied { Vec::new() } else { now.allow });
            let limits = req.limits.unwrap_or(now.net_limits);
            let policy = Policy::parse_for(&mode, &allow, proxied)
                .and_then(|p| p.with_limits(limits))
                .map_err(NetError::from)?;
            let wired = rt.net.wired(&sb.id).is_some();
            let next = match (wired, policy.mode) {
                (false, Mode::None) => None,
                (true, Mode::None) => {
                    rt.net.detach(&sb.id);
                    None
                }
                (false, _) => {
                    let w = rt.net.attach(&sb.id, sb.init_pid, policy.clone())?;
                    rt.ensure_resolver(&sb.id, &sb.rootfs());
                    Some(w)
                }
                (true, _) => Some(rt.net.update(&sb.id, sb.init_pid, policy.clone())?),
            };
            // Unwired with the proxy: its entries are kept for a daemon restart.
            if next.is_none() && proxied {
                rt.net.save_unwired(&sb.id, &policy)?;
            } else if next.is_none() {
                rt.net.detach(&sb.id);
            }
            *sb.net.lock() = NetState { policy, wired: next };
            Ok(network_info(&sb))
        })
        .await
        .map_err(RuntimeError::Worker)?
    }
}

/// `sb`'s network as the API shows it.
pub(crate) fn network_info(sb: &Sandbox) -> NetworkInfo {
    let net = sb.net.lock().clone();
    let (rx, tx) = net.wired.as_ref().map(Wired::counters).unwrap_or((0, 0));
    NetworkInfo {
        sandbox: sb.id.clone(),
        network: net.policy.mode.as_str().to_string(),
        allow: net.policy.allow,
        address: net.wired.as_ref().map(|w| w.address.to_string()),
        proxy: sb.spec.proxy_port.map(proxy::Proxy::url),
        limits: net.policy.limits,
        rx_bytes: rx,
        tx_bytes: tx,
    }
}
