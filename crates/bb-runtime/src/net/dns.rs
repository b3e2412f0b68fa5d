//! The daemon's DNS for sandboxes with egress: a UDP forwarder on the bridge's gateway (every
//! DNS packet a sandbox sends, to any address, is redirected to it).
//!
//! A query from a sandbox in mode `allowlist` for a name its entries do not allow is answered
//! NXDOMAIN without leaving the host. An allowed one is forwarded upstream; the IPv4 addresses
//! of the answer are let through the sandbox's chain for the entry's ports (until the answer's
//! TTL, at least [`MIN_TTL`]) *before* the answer is handed back, so the connection that
//! follows it is never refused. Mode `open` forwards everything. A source that is no sandbox's
//! address gets nothing.

use super::Net;
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RData;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UdpSocket;

/// Shortest time an answer's addresses stay allowed (a client may cache an answer a little
/// longer than its TTL says).
pub const MIN_TTL: u32 = 30;
/// Longest time they stay allowed without a new lookup.
pub const MAX_TTL: u32 = 3600;
/// Queries answered at once; more are dropped (the client retries).
const IN_FLIGHT: usize = 64;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(4);

/// Serve DNS on `sock` until the daemon exits.
pub(crate) async fn serve(net: Arc<Net>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut buf = vec![0u8; 4096];
    loop {
        let (len, from) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("sandbox DNS: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else { continue };
        let (net, sock, packet) = (net.clone(), sock.clone(), buf[..len].to_vec());
        tokio::spawn(async move {
            if let Some(reply) = answer(&net, from, &packet).await {
                let _ = sock.send_to(&reply, from).await;
            }
            drop(permit);
        });
    }
}

async fn answer(net: &Arc<Net>, from: SocketAddr, packet: &[u8]) -> Option<Vec<u8>> {
    let SocketAddr::V4(from4) = from else { return None };
    let (slot, policy) = net.policy_at(*from4.ip())?;
    let query = Message::from_vec(packet).ok()?;
    if query.message_type() != MessageType::Query || query.queries().len() != 1 {
        return refusal(&query, ResponseCode::FormErr);
    }
    let name = query.queries()[0].name().to_ascii();
    if !policy.resolves(&name) {
        tracing::debug!(%from, %name, "sandbox DNS: not on its allowlist");
        return refusal(&query, ResponseCode::NXDomain);
    }
    let upstream = net.dns_upstream?;
    let reply = match forward(upstream, packet).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(%name, %upstream, "sandbox DNS: upstream failed: {e}");
            return refusal(&query, ResponseCode::ServFail);
        }
    };
    let ports = policy.name_ports(&name);
    if !ports.is_empty() {
        let parsed = Message::from_vec(&reply).ok()?;
        let mut addrs: Vec<Ipv4Addr> = Vec::new();
        let mut ttl = MAX_TTL;
        for rec in parsed.answers() {
            if let Some(RData::A(a)) = rec.data() {
                addrs.push(a.0);
                ttl = ttl.min(rec.ttl());
            }
        }
        let ttl = ttl.clamp(MIN_TTL, MAX_TTL);
        let net2 = net.clone();
        let allowed =
            tokio::task::spawn_blocking(move || net2.fabric.allow_answers(slot, &addrs, &ports, ttl)).await.ok()?;
        if let Err(e) = allowed {
            tracing::warn!(%name, "sandbox DNS: could not let the answer through: {e}");
            return refusal(&query, ResponseCode::ServFail);
        }
    }
    Some(reply)
}

async fn forward(upstream: SocketAddr, packet: &[u8]) -> std::io::Result<Vec<u8>> {
    let bind: SocketAddr = if upstream.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("literal");
    let sock = UdpSocket::bind(bind).await?;
    sock.connect(upstream).await?;
    sock.send(packet).await?;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(UPSTREAM_TIMEOUT, sock.recv(&mut buf))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    buf.truncate(n);
    Ok(buf)
}

/// The IPv4 addresses `name` has, asked of `upstream` (the proxy resolves its requests' hosts
/// itself: a sandbox's own answers play no part).
pub(crate) async fn resolve(upstream: SocketAddr, name: &str) -> std::io::Result<Vec<Ipv4Addr>> {
    use hickory_proto::op::Query;
    use hickory_proto::rr::{Name, RecordType};
    let bad = |e: hickory_proto::error::ProtoError| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string());
    let mut q = Message::new();
    let id = (uuid::Uuid::new_v4().as_u128() & 0xffff) as u16;
    q.set_id(id).set_recursion_desired(true);
    q.add_query(Query::query(Name::from_ascii(format!("{name}.")).map_err(bad)?, RecordType::A));
    let reply = Message::from_vec(&forward(upstream, &q.to_vec().map_err(bad)?).await?).map_err(bad)?;
    if reply.id() != id {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "an answer to another query"));
    }
    let addrs: Vec<Ipv4Addr> = reply
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            Some(RData::A(a)) => Some(a.0),
            _ => None,
        })
        .collect();
    if addrs.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no address ({})", reply.response_code()),
        ));
    }
    Ok(addrs)
}

/// An answer with no records and `code`.
fn refusal(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut r = Message::new();
    r.set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    r.add_queries(query.queries().to_vec());
    r.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{Name, RecordType};

    #[test]
    fn a_refusal_answers_the_question_asked() {
        let mut q = Message::new();
        q.set_id(4242).set_recursion_desired(true);
        q.add_query(Query::query(Name::from_ascii("blocked.test.").unwrap(), RecordType::A));
        let r = Message::from_vec(&refusal(&q, ResponseCode::NXDomain).unwrap()).unwrap();
        assert_eq!(r.id(), 4242);
        assert_eq!(r.message_type(), MessageType::Response);
        assert_eq!(r.response_code(), ResponseCode::NXDomain);
        assert_eq!(r.queries()[0].name().to_ascii(), "blocked.test.");
        assert!(r.answers().is_empty());
    }
}
