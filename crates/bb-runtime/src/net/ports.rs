//! Ports: a server listening inside a sandbox, reached from the host.
//!
//! `GET /v1/sandboxes/{id}/ports/{port}` opens (once; later calls answer the same) a listener on
//! `--port-bind` (127.0.0.1) at a port the kernel picks. Each connection to it is joined to
//! `127.0.0.1:{port}` in the sandbox's network namespace: the socket is made by a short-lived
//! thread that entered the namespace of the sandbox's init (a socket stays in the namespace it
//! was made in; `bb_sys::ns::tcp_socket_in`), then connected and copied both ways on the
//! daemon's async runtime. It works whatever the sandbox's network mode, `none` too: nothing
//! but the daemon reaches in, and only to the ports asked for. The sandbox is looked up by id at
//! every connection: one that is paused or dead gets the connection closed at once, one that is
//! gone (killed: its init may live on as a warm pool shell of another sandbox) closes the
//! listener; a kill closes its listeners right away too.
//!
//! On the daemon's TCP listener (`--listen`), a request whose Host header is
//! `{port}-{sandbox}.{domain}` (`--port-domain`, default `localhost`) is forwarded to that port
//! of that sandbox, without the API's token (as peers' public port URLs), any port, no
//! listener to open first ([`Runtime::forward_to_port`]; WebSocket upgrades are joined).

use crate::error::{Result, RuntimeError};
use crate::model::{PortInfo, PortList};
use crate::{now, Runtime};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Weak};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// Most ports open at once per sandbox.
pub const MAX_PORTS: usize = 32;

/// The open ports of every sandbox, by (sandbox, port).
#[derive(Default)]
pub struct Ports {
    open: Mutex<BTreeMap<(String, u16), Forward>>,
}

struct Forward {
    info: PortInfo,
    /// The listener (a second fd of it): shut down when the port closes, so that it refuses
    /// connections from then on, not once its task got to run.
    listener: std::os::fd::OwnedFd,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Forward {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        // Joined connections end with their peers.
        self.accept.abort();
    }
}

impl Ports {
    /// Close every port of sandbox `id` (it was killed). Returns how many.
    pub(crate) fn close_all(&self, id: &str) -> usize {
        let mut open = self.open.lock();
        let keys: Vec<(String, u16)> = open.keys().filter(|(s, _)| s == id).cloned().collect();
        for k in &keys {
            open.remove(k);
        }
        keys.len()
    }
}

fn check_port(port: u32) -> Result<u16> {
    match u16::try_from(port) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(RuntimeError::BadRequest(format!("port {port}: use a TCP port from 1 to 65535"))),
    }
}

impl Runtime {
    /// The host address reaching port `port` of sandbox `id`, its listener opened on first ask.
    pub async fn open_port(self: &Arc<Self>, id: &str, port: u32) -> Result<PortInfo> {
        let port = check_port(port)?;
        let sb = self.sandboxes.get(id).ok_or_else(|| RuntimeError::sandbox(id))?;
        if let Some(f) = self.ports.open.lock().get(&(sb.id.clone(), port)) {
            return Ok(f.info.clone());
        }
        if sb.paused.lock().is_some() {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} is paused: resume it (`branchbox sandbox resume {id}`), then open its port"
            )));
        }
        let listener = TcpListener::bind(SocketAddr::new(self.cfg.port_bind, 0))
            .await
            .map_err(RuntimeError::io("listen for a sandbox port"))?;
        let addr = listener.local_addr().map_err(RuntimeError::io("listen for a sandbox port"))?;
        let listener_fd = {
            use std::os::fd::AsFd;
            listener.as_fd().try_clone_to_owned().map_err(RuntimeError::io("listen for a sandbox port"))?
        };
        let host = addr.to_string();
        let domain_host = self.cfg.port_domain.as_ref().map(|d| format!("{port}-{}.{d}", sb.id));
        let info = PortInfo {
            sandbox: sb.id.clone(),
            port,
            url: format!("http://{host}"),
            host,
            domain_host,
            opened_at: now(),
        };
        let mut open = self.ports.open.lock();
        // Asked twice at once: the first listener serves; this one goes unused.
        if let Some(f) = open.get(&(sb.id.clone(), port)) {
            return Ok(f.info.clone());
        }
        if open.keys().filter(|(s, _)| *s == sb.id).count() >= MAX_PORTS {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} has {MAX_PORTS} ports open, the most it may: close one first \
                 (`branchbox sandbox port {id} PORT --close`)"
            )));
        }
        // Killed while the listener was made: nothing is left open for it.
        if self.sandboxes.get(id).is_none_or(|now| !Arc::ptr_eq(&now, &sb)) {
            return Err(RuntimeError::sandbox(id));
        }
        let accept = tokio::spawn(accept_loop(Arc::downgrade(self), sb.id.clone(), port, listener));
        open.insert((sb.id.clone(), port), Forward { info: info.clone(), listener: listener_fd, accept });
        tracing::info!(sandbox = %sb.id, port, host = %info.host, "sandbox port opened");
        Ok(info)
    }

    /// The ports of sandbox `id` open now, by port.
    pub fn list_ports(&self, id: &str) -> Result<PortList> {
        let sb = self.sandboxes.get(id).ok_or_else(|| RuntimeError::sandbox(id))?;
        let open = self.ports.open.lock();
        Ok(PortList { ports: open.iter().filter(|((s, _), _)| *s == sb.id).map(|(_, f)| f.info.clone()).collect() })
    }

    /// Close port `port` of sandbox `id`; false: it was not open. Connections joined through it
    /// end with their peers.
    pub fn close_port(&self, id: &str, port: u32) -> Result<bool> {
        let port = check_port(port)?;
        let sb = self.sandboxes.get(id).ok_or_else(|| RuntimeError::sandbox(id))?;
        Ok(self.ports.open.lock().remove(&(sb.id.clone(), port)).is_some())
    }
}

async fn accept_loop(rt: Weak<Runtime>, id: String, port: u16, listener: TcpListener) {
    loop {
        let client = match listener.accept().await {
            Ok((c, _)) => c,
            // Shut down: the port was closed.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return,
            Err(e) => {
                // Out of fds or the like: the next accept may work.
                tracing::warn!(sandbox = %id, port, "accepting a connection to a sandbox port: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(rt) = rt.upgrade() else { return };
        let Some(sb) = rt.sandboxes.get(&id) else {
            rt.ports.close_all(&id);
            return;
        };
        if sb.is_dead() || sb.paused.lock().is_some() {
            tracing::debug!(sandbox = %id, port, "connection to a sandbox port closed: the sandbox is dead or paused");
            continue;
        }
        let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", sb.init_pid));
        let id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = join(client, netns, port).await {
                tracing::debug!(sandbox = %id, port, "sandbox port connection: {e}");
            }
        });
    }
}

/// A connection to `127.0.0.1:port` in network namespace `netns`.
async fn dial(netns: std::path::PathBuf, port: u16) -> std::io::Result<TcpStream> {
    let fd = tokio::task::spawn_blocking(move || bb_sys::ns::tcp_socket_in(&netns))
        .await
        .map_err(std::io::Error::other)?
        .map_err(|e| e.source)?;
    let socket = TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
    let upstream = socket.connect(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port)).await?;
    let _ = upstream.set_nodelay(true);
    Ok(upstream)
}

/// Join `client` to `127.0.0.1:port` in network namespace `netns` until either side closes.
async fn join(mut client: TcpStream, netns: std::path::PathBuf, port: u16) -> std::io::Result<()> {
    let mut upstream = dial(netns, port).await?;
    let _ = client.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await.map(drop)
}

/// The sandbox and port a Host header of the form `{port}-{sandbox}.{domain}` names (its own
/// `:port`, the daemon's, ignored; case ignored).
pub fn port_host(host: &str, domain: &str) -> Option<(String, u16)> {
    let host = match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    let (host, domain) = (host.to_ascii_lowercase(), domain.trim_matches('.').to_ascii_lowercase());
    let label = host.trim_end_matches('.').strip_suffix(domain.as_str())?.strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    if id.is_empty() || id.contains('.') {
        return None;
    }
    Some((id.to_string(), port.parse::<u16>().ok().filter(|&p| p > 0)?))
}

impl Runtime {
    /// Forward `req` (sent to the Host-header form of a port, `{port}-{sandbox}.{domain}` on the
    /// daemon's TCP listener) to port `port` of sandbox `id`, and its answer back; an upgrade
    /// (WebSocket) the server agrees to is joined both ways.
    pub async fn forward_to_port<B>(
        &self,
        id: &str,
        port: u16,
        mut req: hyper::Request<B>,
    ) -> Result<hyper::Response<http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>>>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        use http_body_util::BodyExt;
        let sb = self.get(id)?;
        if sb.is_dead() || sb.paused.lock().is_some() {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} is {}: its ports answer while it runs",
                if sb.is_dead() { "dead" } else { "paused" }
            )));
        }
        let netns = std::path::PathBuf::from(format!("/proc/{}/ns/net", sb.init_pid));
        let upstream = dial(netns, port).await.map_err(|e| {
            RuntimeError::Unavailable(format!(
                "nothing answers on port {port} in sandbox {id} ({e}): start a server there"
            ))
        })?;
        let client_upgrade = hyper::upgrade::on(&mut req);
        let mut resp = crate::net::proxy::send(upstream, req)
            .await
            .map_err(|e| RuntimeError::Unavailable(format!("port {port} of sandbox {id}: {e}")))?;
        if resp.status() == hyper::StatusCode::SWITCHING_PROTOCOLS {
            let server_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(c), Ok(s)) = tokio::join!(client_upgrade, server_upgrade) {
                    let (mut c, mut s) = (hyper_util::rt::TokioIo::new(c), hyper_util::rt::TokioIo::new(s));
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                }
            });
        }
        Ok(resp.map(|b| b.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_form_names_a_sandbox_and_a_port() {
        let ok = |h: &str| port_host(h, "localhost");
        assert_eq!(ok("8000-sb-1a2b.localhost"), Some(("sb-1a2b".into(), 8000)));
        assert_eq!(ok("8000-SB-1a2b.LocalHost.:7070"), Some(("sb-1a2b".into(), 8000)));
        assert_eq!(port_host("80-x.sandbox.example.com", ".sandbox.example.com."), Some(("x".into(), 80)));
        for bad in [
            "localhost",
            "8000.localhost",
            "0-x.localhost",
            "70000-x.localhost",
            "a-x.localhost",
            "8000-.localhost",
            "8000-x.y.localhost",
            "8000-x.notlocalhost",
            "8000-xlocalhost",
        ] {
            assert_eq!(ok(bad), None, "{bad}");
        }
    }

    #[test]
    fn ports_out_of_range_are_refused_with_the_range() {
        assert_eq!(check_port(1).unwrap(), 1);
        assert_eq!(check_port(65535).unwrap(), 65535);
        for bad in [0, 65536, 1 << 20] {
            let e = check_port(bad).unwrap_err().to_string();
            assert!(e.contains("1 to 65535"), "{e}");
        }
    }
}
