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
        let info = PortInfo { sandbox: sb.id.clone(), port, url: format!("http://{host}"), host, opened_at: now() };
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

/// Join `client` to `127.0.0.1:port` in network namespace `netns` until either side closes.
async fn join(mut client: TcpStream, netns: std::path::PathBuf, port: u16) -> std::io::Result<()> {
    let fd = tokio::task::spawn_blocking(move || bb_sys::ns::tcp_socket_in(&netns))
        .await
        .map_err(std::io::Error::other)?
        .map_err(|e| e.source)?;
    let socket = TcpSocket::from_std_stream(std::net::TcpStream::from(fd));
    let mut upstream = socket.connect(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port)).await?;
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

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
