//! The daemon's HTTP(S) forwarding proxy for sandboxes: an agent's model calls leave through
//! it, outside the agent's address space, under the sandbox's allowlist, with credentials the
//! sandbox never sees.
//!
//! A sandbox created with `proxy: true` gets a listener of the daemon's *inside its own network
//! namespace* at `127.0.0.1:{--proxy-port}` (made like a port's socket: by a short-lived thread
//! that entered the namespace), and `HTTP_PROXY`/`HTTPS_PROXY` naming it in its environment.
//! That works in every network mode: in `none` the proxy is the sandbox's only way out. Each
//! request is checked against the sandbox's policy *now* ([`Proxy::destination`]): the name
//! must be one its allow entries list (mode `open`: any), and the address it resolves to (the
//! daemon asks `--net-dns` itself) must not be loopback, link-local/metadata, multicast, the
//! sandboxes' range or one of the host's own addresses, unless an address entry lists it.
//! - `CONNECT host:port` (https): a tunnel, once the first record the client sends (its TLS
//!   ClientHello) names the same host (SNI) or none; the tunnel is closed otherwise.
//! - `GET http://host/...` (absolute form): forwarded, hop-by-hop headers dropped. With a
//!   credential for that host (`--proxy-credentials`), its headers are set on the way out
//!   (replacing the sandbox's own), and with `"tls": true` the request goes upstream over
//!   HTTPS (system roots plus `--proxy-ca`): an agent calls `http://api.example.com/...` and
//!   never holds the key.
//!
//! The sandbox's end of a proxied connection is an ordinary loopback socket, and the upstream
//! end lives in the daemon, so a checkpoint (which freezes the sandbox for milliseconds and
//! copies no socket) does not wait for a request in flight, and its answer reaches the process
//! that asked. A fork child does not get its parent's connections (a session copy's are reset,
//! see `session/server.py`). A sandbox's connections are limited to [`MAX_CONNECTIONS`] at once.
//!
//! A sandbox created with `proxy_record` has the answers to its plaintext requests recorded
//! and replayed after a rollback or in a fork child ([`super::record`]).

use super::dns;
use super::inflight::{self, Flight, Flying, InFlight};
use super::policy::{Mode, Policy};
use super::record::{self, Recorder};
use crate::sandbox::Sandbox;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ipnet::Ipv4Net;
use parking_lot::Mutex;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

/// Most connections one sandbox holds to the proxy at once; more are closed on arrival.
pub const MAX_CONNECTIONS: usize = 256;
/// Default port of the proxy inside sandboxes (`--proxy-port`).
pub const DEFAULT_PORT: u16 = 3128;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a tunnel's client has to send its first record.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest TLS record (a ClientHello fits one).
const MAX_RECORD: usize = 5 + 16384;
/// Ranges no proxied request reaches unless an address entry lists them (as the fabric's
/// `blocked` set, plus the host's own addresses, checked at each request).
const REFUSED: &[(Ipv4Addr, u8)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 3),
];

/// What the daemon adds to requests for one host (`--proxy-credentials`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credential {
    /// Set on every plaintext request for the host (replacing the sandbox's own).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Send the request upstream over HTTPS.
    #[serde(default)]
    pub tls: bool,
    /// Upstream port (default 443 with `tls`, else the request's).
    #[serde(default)]
    pub port: Option<u16>,
}

#[derive(Debug, Error)]
pub enum ProxyError {
    #[error("--proxy-credentials {path}: {why}")]
    Credentials { path: PathBuf, why: String },
    #[error("--proxy-ca {path}: {why}")]
    Ca { path: PathBuf, why: String },
    #[error("the proxy cannot listen in sandbox {id} on 127.0.0.1:{port}: {source}")]
    Listen { id: String, port: u16, source: std::io::Error },
}

/// Read `--proxy-credentials`: a JSON object, host name -> [`Credential`].
pub fn load_credentials(path: &Path) -> Result<HashMap<String, Credential>, ProxyError> {
    let bad = |why: String| ProxyError::Credentials { path: path.to_path_buf(), why };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let map: BTreeMap<String, Credential> = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "{e}: write a JSON object {{\"api.example.com\": {{\"headers\": {{\"Authorization\": \"Bearer ...\"}}, \"tls\": true}}}}"
        ))
    })?;
    let mut out = HashMap::new();
    for (host, c) in map {
        for (k, v) in &c.headers {
            if HeaderName::from_bytes(k.as_bytes()).is_err() || HeaderValue::from_str(v).is_err() {
                return Err(bad(format!("host {host:?}: header {k:?} is not a valid HTTP header")));
            }
        }
        out.insert(host.trim_end_matches('.').to_ascii_lowercase(), c);
    }
    Ok(out)
}

fn tls_connector(ca: Option<&Path>) -> Result<tokio_rustls::TlsConnector, ProxyError> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca {
        let bad = |why: String| ProxyError::Ca { path: path.to_path_buf(), why };
        let certs = CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))?;
        let mut n = 0;
        for cert in certs {
            roots.add(cert.map_err(|e| bad(e.to_string()))?).map_err(|e| bad(e.to_string()))?;
            n += 1;
        }
        if n == 0 {
            return Err(bad("no certificate in it: give a PEM file of CA certificates".into()));
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| ProxyError::Ca { path: ca.map(Path::to_path_buf).unwrap_or_default(), why: e.to_string() })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A listener made in a sandbox's namespace, not served yet.
pub(crate) struct Listening {
    id: String,
    listener: TcpListener,
    second: OwnedFd,
    handle: tokio::runtime::Handle,
}

/// One sandbox's listener.
struct Entry {
    /// The listener (a second fd of it): shut down when the entry goes.
    listener: OwnedFd,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        // Connections in flight end with their peers.
        self.accept.abort();
    }
}

pub struct Proxy {
    pub port: u16,
    credentials: HashMap<String, Credential>,
    tls: tokio_rustls::TlsConnector,
    /// The sandboxes' range (refused as a destination).
    range: Ipv4Net,
    dns: Option<SocketAddr>,
    open: Mutex<HashMap<String, Entry>>,
    /// Answers recorded for the sandboxes created with `proxy_record`.
    pub(crate) recorder: Arc<Recorder>,
    /// Requests in flight, and those handed to fork children (fork option `replay_inflight`).
    pub(crate) inflight: Arc<InFlight>,
}

/// A request the proxy answers itself.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    why: String,
}

impl Refusal {
    fn new(status: StatusCode, why: impl Into<String>) -> Refusal {
        Refusal { status, why: why.into() }
    }

    fn response(self) -> Response<Body> {
        let mut r = Response::new(full(format!("branchbox proxy: {}\n", self.why)));
        *r.status_mut() = self.status;
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
        r
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn full(s: String) -> Body {
    whole(Bytes::from(s))
}

/// A body of `b`, all at once.
fn whole(b: Bytes) -> Body {
    Full::new(b).map_err(|never| match never {}).boxed()
}

/// The host's own IPv4 addresses (a proxied request never reaches a host service).
fn host_addresses() -> Vec<Ipv4Addr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    addrs.filter_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip())).collect()
}

impl Proxy {
    pub fn new(
        port: u16,
        credentials: HashMap<String, Credential>,
        ca: Option<&Path>,
        range: Ipv4Net,
        dns: Option<SocketAddr>,
    ) -> Result<Proxy, ProxyError> {
        Ok(Proxy {
            port,
            credentials,
            tls: tls_connector(ca)?,
            range,
            dns,
            open: Mutex::new(HashMap::new()),
            recorder: Arc::default(),
            inflight: Arc::default(),
        })
    }

    /// The proxy's URL as seen inside a sandbox.
    pub fn url(port: u16) -> String {
        format!("http://127.0.0.1:{port}")
    }

    /// Listen for sandbox `id` in the network namespace of its init `pid`. Blocking; needs
    /// the tokio runtime.
    pub(crate) fn listen(&self, id: &str, pid: i32, port: u16) -> Result<Listening, ProxyError> {
        use std::os::fd::AsRawFd;
        let listen_err = |source: std::io::Error| ProxyError::Listen { id: id.to_string(), port, source };
        let fd =
            bb_sys::ns::tcp_socket_in(Path::new(&format!("/proc/{pid}/ns/net"))).map_err(|e| listen_err(e.source))?;
        let addr = nix::sys::socket::SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        let nix_err = |e: nix::Error| listen_err(e.into());
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReuseAddr, &true).map_err(nix_err)?;
        // Loopback may not be up yet in a namespace just made: bind all the same.
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::IpFreebind, &true).map_err(nix_err)?;
        nix::sys::socket::bind(fd.as_raw_fd(), &addr).map_err(nix_err)?;
        nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::new(128).expect("in range")).map_err(nix_err)?;
        let second = fd.try_clone().map_err(listen_err)?;
        let handle =
            tokio::runtime::Handle::try_current().map_err(|e| listen_err(std::io::Error::other(e.to_string())))?;
        let listener = {
            let _guard = handle.enter();
            TcpListener::from_std(std::net::TcpListener::from(fd)).map_err(listen_err)?
        };
        Ok(Listening { id: id.to_string(), listener, second, handle })
    }

    /// Serve sandbox `sb` on what [`Proxy::listen`] made, its requests held to its policy at
    /// each request.
    pub(crate) fn serve(self: &Arc<Self>, l: Listening, sb: &Arc<Sandbox>) {
        let accept = l.handle.spawn(accept_loop(self.clone(), l.id.clone(), Arc::downgrade(sb), l.listener));
        self.open.lock().insert(l.id, Entry { listener: l.second, accept });
    }

    /// Stop listening for sandbox `id` (killed). Its connections end with their peers.
    pub(crate) fn close(&self, id: &str) {
        self.open.lock().remove(id);
        self.recorder.forget(id);
        self.inflight.forget(id);
    }

    fn refused(&self, ip: Ipv4Addr, local: &[Ipv4Addr]) -> bool {
        REFUSED.iter().any(|&(net, len)| Ipv4Net::new(net, len).expect("literal").contains(&ip))
            || self.range.contains(&ip)
            || local.contains(&ip)
    }

    /// Where `host:port` is reached for a sandbox held to `policy`, or why it is not.
    async fn destination(&self, policy: &Policy, host: &str, port: u16) -> Result<SocketAddr, Refusal> {
        let forbidden = |why: &str| Refusal::new(StatusCode::FORBIDDEN, format!("{host}:{port} {why}"));
        let listed = |ip: Ipv4Addr| policy.nets().any(|(n, p)| n.contains(&ip) && (p.low..=p.high).contains(&port));
        let host = host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
        let (addrs, by_name) = if let Ok(ip) = host.parse::<Ipv4Addr>() {
            (vec![ip], false)
        } else if host.contains(':') {
            return Err(forbidden("is IPv6: sandboxes reach IPv4 only"));
        } else {
            let named = policy.name_ports(&host).iter().any(|p| (p.low..=p.high).contains(&port));
            if !named && policy.mode != Mode::Open {
                return Err(forbidden(
                    "is not on the sandbox's allowlist (add it with `sbx.network.update(allow=...)`)",
                ));
            }
            let Some(upstream) = self.dns else {
                return Err(Refusal::new(StatusCode::BAD_GATEWAY, "the daemon has no DNS upstream (--net-dns)"));
            };
            let addrs = dns::resolve(upstream, &host)
                .await
                .map_err(|e| Refusal::new(StatusCode::BAD_GATEWAY, format!("{host} does not resolve: {e}")))?;
            (addrs, true)
        };
        let local = host_addresses();
        for ip in addrs {
            if listed(ip) || (!self.refused(ip, &local) && (by_name || policy.mode == Mode::Open)) {
                return Ok(SocketAddr::new(ip.into(), port));
            }
        }
        Err(forbidden(if by_name {
            "resolves only to addresses sandboxes may not reach (loopback, link-local, the host, other sandboxes)"
        } else {
            "is not an address the sandbox may reach: list it in its allow entries"
        }))
    }

    async fn handle(self: Arc<Self>, id: &str, sb: &Weak<Sandbox>, req: Request<Incoming>) -> Response<Body> {
        let Some(policy) = sb.upgrade().filter(|sb| !sb.is_dead()).map(|sb| sb.net.lock().policy.clone()) else {
            return Refusal::new(StatusCode::FORBIDDEN, "the sandbox is gone").response();
        };
        let done = if req.method() == Method::CONNECT {
            self.tunnel(id, &policy, req).await
        } else {
            self.forward(id, &policy, req).await
        };
        done.unwrap_or_else(|r| {
            tracing::info!(sandbox = %id, status = %r.status, "proxy: {}", r.why);
            r.response()
        })
    }

    /// `CONNECT host:port`: a tunnel, checked against the client's first record.
    async fn tunnel(&self, id: &str, policy: &Policy, req: Request<Incoming>) -> Result<Response<Body>, Refusal> {
        let bad = || Refusal::new(StatusCode::BAD_REQUEST, "CONNECT needs host:port");
        let auth = req.uri().authority().cloned().ok_or_else(bad)?;
        let port = auth.port_u16().ok_or_else(bad)?;
        let host = auth.host().trim_end_matches('.').to_ascii_lowercase();
        let addr = self.destination(policy, &host, port).await?;
        let mut upstream = connect(addr).await?;
        let name = host.parse::<Ipv4Addr>().is_err().then_some(host);
        let id = id.to_string();
        tokio::spawn(async move {
            let Ok(up) = hyper::upgrade::on(req).await else { return };
            let mut client = TokioIo::new(up);
            let Ok(Ok(first)) = tokio::time::timeout(HELLO_TIMEOUT, first_record(&mut client)).await else { return };
            if let (Some(name), Some(sni)) = (&name, tls_sni(&first)) {
                if !sni.eq_ignore_ascii_case(name) {
                    tracing::info!(sandbox = %id, %name, %sni, "proxy: tunnel closed: its TLS names another host");
                    return;
                }
            }
            if upstream.write_all(&first).await.is_ok() {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            }
        });
        Ok(Response::new(full(String::new())))
    }

    /// A plaintext request in absolute form, forwarded (with its host's credential).
    async fn forward(&self, id: &str, policy: &Policy, req: Request<Incoming>) -> Result<Response<Body>, Refusal> {
        let uri = req.uri().clone();
        match uri.scheme_str() {
            Some("http") => {}
            Some(s) => {
                return Err(Refusal::new(StatusCode::BAD_REQUEST, format!("{s}:// goes through CONNECT (HTTPS_PROXY)")))
            }
            None => {
                return Err(Refusal::new(
                    StatusCode::BAD_REQUEST,
                    "send requests as absolute URLs (the client's HTTP_PROXY setting does)",
                ))
            }
        }
        let host = uri.host().unwrap_or_default().trim_end_matches('.').to_ascii_lowercase();
        let asked = uri.port_u16().unwrap_or(80);
        let cred = self.credentials.get(&host);
        let (port, tls) = match cred {
            Some(c) if c.tls => (c.port.unwrap_or(443), true),
            Some(c) => (c.port.unwrap_or(asked), false),
            None => (asked, false),
        };
        let addr = self.destination(policy, &host, port).await?;
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        // The request of a recording sandbox, or of a fork child handed its parent's requests in
        // flight, is read whole (to match it), and may be answered from the record or with the
        // parent's answer.
        let recording = self.recorder.records(id);
        let (mut req, key) = if recording || self.inflight.owes(id) {
            let (parts, body) = req.into_parts();
            let body = http_body_util::Limited::new(body, record::MAX_REQUEST).collect().await.map_err(|e| {
                Refusal::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "a recording sandbox's request body is read whole, at most {} MiB: {e}",
                        record::MAX_REQUEST >> 20
                    ),
                )
            })?;
            let body = body.to_bytes();
            let key = record::key(parts.method.as_str(), &host, asked, path, &body);
            if let Some(parents) = self.inflight.take(id, &key) {
                if let Some(a) = parents.answer().await {
                    self.recorder.record(id, key, a.clone());
                    return Ok(replayed(&a));
                }
            }
            if let Some(a) = self.recorder.replay(id, &key) {
                return Ok(replayed(&a));
            }
            (Request::from_parts(parts, whole(body)), Some(key))
        } else {
            (req.map(BodyExt::boxed), None)
        };
        let flying = self.inflight.begin(id, key);
        if key.is_none() {
            let hasher = record::hasher(req.method().as_str(), &host, asked, path);
            let flight = flying.flight().clone();
            req = req.map(|b| Watched::new(b, Keyed { hasher: Some(hasher), flight }).boxed());
        }
        *req.uri_mut() = path.parse().map_err(|_| Refusal::new(StatusCode::BAD_REQUEST, "bad request path"))?;
        strip_hop_by_hop(req.headers_mut());
        let host_header = if cred.is_some() || port == 80 { host.clone() } else { format!("{host}:{port}") };
        req.headers_mut().insert(
            HOST,
            HeaderValue::from_str(&host_header).map_err(|_| Refusal::new(StatusCode::BAD_REQUEST, "bad host"))?,
        );
        for (k, v) in cred.map(|c| &c.headers).into_iter().flatten() {
            // Checked when the file was read.
            if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
                req.headers_mut().insert(k, v);
            }
        }
        let tcp = connect(addr).await?;
        let upstream = |e: hyper::Error| Refusal::new(StatusCode::BAD_GATEWAY, format!("upstream: {e}"));
        let resp = if tls {
            let name = rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|_| Refusal::new(StatusCode::BAD_REQUEST, format!("{host} is not a TLS server name")))?;
            let stream = self
                .tls
                .connect(name, tcp)
                .await
                .map_err(|e| Refusal::new(StatusCode::BAD_GATEWAY, format!("TLS to {host}:{port}: {e}")))?;
            send(stream, req).await.map_err(upstream)?
        } else {
            send(tcp, req).await.map_err(upstream)?
        };
        let mut resp = resp.map(|b| b.boxed());
        // The proxy answers in its own version (RFC 9110 7.6.1), whatever the upstream spoke.
        *resp.version_mut() = hyper::Version::HTTP_11;
        Ok(self.keeping(id, recording.then_some(key).flatten(), flying, resp))
    }

    /// `resp`, its body kept as it passes: once it has all passed it settles `flying` and, for a
    /// recording sandbox, is recorded as the answer to `key`.
    fn keeping(&self, id: &str, key: Option<record::Key>, flying: Flying, resp: Response<Body>) -> Response<Body> {
        let (parts, body) = resp.into_parts();
        let (status, headers) = (parts.status, parts.headers.clone());
        let (rec, inflight, id) = (self.recorder.clone(), self.inflight.clone(), id.to_string());
        let done = Box::new(move |body: Option<Bytes>| {
            let answer = body.map(|body| Arc::new(record::Answer { status, headers, body }));
            if let (Some(key), Some(a)) = (key, &answer) {
                rec.record(&id, key, a.clone());
            }
            flying.settle(answer);
            inflight.prune(&id);
        });
        let limit = if key.is_some() { record::MAX_ANSWER } else { inflight::MAX_KEPT };
        Response::from_parts(parts, Watched::new(body, Tee::new(limit, done)).boxed())
    }
}

/// A recorded answer, sent again.
fn replayed(a: &record::Answer) -> Response<Body> {
    let mut r = Response::new(whole(a.body.clone()));
    *r.status_mut() = a.status;
    *r.headers_mut() = a.headers.clone();
    // Framed anew for the whole body.
    r.headers_mut().remove(hyper::header::TRANSFER_ENCODING);
    r.headers_mut().insert(hyper::header::CONTENT_LENGTH, HeaderValue::from(a.body.len()));
    r
}

/// What a [`Watched`] body is told as it passes.
trait Watcher: Send + Sync + Unpin {
    fn data(&mut self, data: &Bytes);
    /// The body has all passed (told once; never after [`Watcher::failed`]).
    fn end(&mut self);
    fn failed(&mut self);
}

/// A body passed on as it comes, told to its watcher.
struct Watched<W> {
    inner: Body,
    watcher: W,
    over: bool,
}

impl<W: Watcher> Watched<W> {
    fn new(inner: Body, watcher: W) -> Watched<W> {
        let mut w = Watched { inner, watcher, over: false };
        // An empty body may never be polled.
        if hyper::body::Body::is_end_stream(&w.inner) {
            w.over = true;
            w.watcher.end();
        }
        w
    }
}

impl<W: Watcher> hyper::body::Body for Watched<W> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if this.over {
            return polled;
        }
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.watcher.data(data);
                }
                // The server stops polling once the body says it ended.
                if this.inner.is_end_stream() {
                    this.over = true;
                    this.watcher.end();
                }
            }
            Poll::Ready(Some(Err(_))) => {
                this.over = true;
                this.watcher.failed();
            }
            Poll::Ready(None) => {
                this.over = true;
                this.watcher.end();
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// What a [`Tee`] calls once its body has passed: with the body, or None if it failed, was
/// dropped first or was larger than kept.
type TeeDone = Box<dyn FnOnce(Option<Bytes>) + Send + Sync>;

/// Keeps a body as it passes (up to `limit` bytes): once it has all passed, `done` gets it.
struct Tee {
    limit: usize,
    kept: Option<Vec<u8>>,
    done: Option<TeeDone>,
}

impl Tee {
    fn new(limit: usize, done: TeeDone) -> Tee {
        Tee { limit, kept: Some(Vec::new()), done: Some(done) }
    }

    fn finish(&mut self) {
        if let Some(done) = self.done.take() {
            done(self.kept.take().map(Bytes::from));
        }
    }
}

impl Watcher for Tee {
    fn data(&mut self, data: &Bytes) {
        if let Some(kept) = self.kept.as_mut() {
            if kept.len() + data.len() > self.limit {
                self.kept = None;
            } else {
                kept.extend_from_slice(data);
            }
        }
    }

    fn end(&mut self) {
        self.finish();
    }

    fn failed(&mut self) {
        self.kept = None;
        self.finish();
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        self.failed();
    }
}

/// Hashes a request body as it comes: once it has all come, its flight is keyed (see
/// [`record::hasher`]).
struct Keyed {
    hasher: Option<blake3::Hasher>,
    flight: Arc<Flight>,
}

impl Watcher for Keyed {
    fn data(&mut self, data: &Bytes) {
        if let Some(h) = self.hasher.as_mut() {
            h.update(data);
        }
    }

    fn end(&mut self) {
        if let Some(h) = self.hasher.take() {
            self.flight.keyed(*h.finalize().as_bytes());
        }
    }

    /// Never keyed: no child's request matches it.
    fn failed(&mut self) {
        self.hasher = None;
    }
}

async fn connect(addr: SocketAddr) -> Result<TcpStream, Refusal> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(Refusal::new(StatusCode::BAD_GATEWAY, format!("{addr}: {e}"))),
        Err(_) => Err(Refusal::new(StatusCode::GATEWAY_TIMEOUT, format!("{addr}: no answer to connect"))),
    }
}

/// Send `req` over `io` (HTTP/1.1; an upgrade the answer agrees to is carried on `io`).
pub(crate) async fn send<S, B>(io: S, req: Request<B>) -> hyper::Result<Response<Incoming>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    sender.send_request(req).await
}

/// Drop the headers meant for the proxy or for one hop only.
fn strip_hop_by_hop(h: &mut hyper::HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in ["connection", "proxy-connection", "proxy-authorization", "keep-alive", "te", "upgrade"] {
        h.remove(n);
    }
}

/// One connection to the proxy, counted while it is open.
struct Counted(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn accept_loop(proxy: Arc<Proxy>, id: String, sb: Weak<Sandbox>, listener: TcpListener) {
    use std::sync::atomic::Ordering;
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Shut down (the sandbox was killed): the task is aborted at once.
                tracing::debug!(sandbox = %id, "proxy accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // The sandbox's own cap (its policy now), within the proxy's.
        let cap = sb.upgrade().and_then(|sb| sb.net.lock().policy.limits.max_connections).map(|m| m as usize);
        let cap = cap.unwrap_or(MAX_CONNECTIONS).min(MAX_CONNECTIONS);
        if open.fetch_add(1, Ordering::SeqCst) >= cap {
            open.fetch_sub(1, Ordering::SeqCst);
            tracing::info!(sandbox = %id, "proxy: {cap} connections open, the most the sandbox may: closed a new one");
            continue;
        }
        let permit = Counted(open.clone());
        let _ = stream.set_nodelay(true);
        let (proxy, id, sb) = (proxy.clone(), id.clone(), sb.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let (proxy, id, sb) = (proxy.clone(), id.clone(), sb.clone());
                async move { Ok::<_, Infallible>(proxy.handle(&id, &sb, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades()
                .await;
            drop(permit);
        });
    }
}

/// The client's first record of a tunnel: a whole TLS record if it starts one, else what came
/// in the first read.
async fn first_record<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; MAX_RECORD];
    let mut have = 0;
    loop {
        let n = s.read(&mut buf[have..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        have += n;
        if buf[0] != 0x16 {
            break;
        }
        if have >= 5 {
            let want = (5 + u16::from_be_bytes([buf[3], buf[4]]) as usize).min(MAX_RECORD);
            if have >= want {
                break;
            }
        }
    }
    buf.truncate(have);
    Ok(buf)
}

/// The server name (SNI) a TLS ClientHello record asks for, if it is one and names one.
pub fn tls_sni(record: &[u8]) -> Option<String> {
    struct Cur<'a>(&'a [u8]);
    impl<'a> Cur<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            (self.0.len() >= n).then(|| {
                let (a, b) = self.0.split_at(n);
                self.0 = b;
                a
            })
        }
        fn u8(&mut self) -> Option<usize> {
            self.take(1).map(|b| b[0] as usize)
        }
        fn u16(&mut self) -> Option<usize> {
            self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
        }
        fn vec8(&mut self) -> Option<&'a [u8]> {
            let n = self.u8()?;
            self.take(n)
        }
        fn vec16(&mut self) -> Option<&'a [u8]> {
            let n = self.u16()?;
            self.take(n)
        }
    }
    let mut c = Cur(record);
    // Record header: handshake, version, length; then a ClientHello (type 1, 24-bit length).
    if c.u8()? != 0x16 {
        return None;
    }
    c.take(4)?;
    if c.u8()? != 1 {
        return None;
    }
    c.take(3 + 2 + 32)?; // length, client version, random
    c.vec8()?; // session id
    c.vec16()?; // cipher suites
    c.vec8()?; // compression methods
    let mut exts = Cur(c.vec16()?);
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let mut body = Cur(exts.vec16()?);
        if kind != 0 {
            continue;
        }
        let mut list = Cur(body.vec16()?);
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type == 0 {
                return std::str::from_utf8(name).ok().map(str::to_string);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello record with (or without) an SNI extension, plus another extension first.
    fn hello(sni: Option<&str>) -> Vec<u8> {
        let mut exts = vec![0x00, 0x0b, 0x00, 0x02, 0x01, 0x00]; // ec_point_formats
        if let Some(name) = sni {
            let n = name.len() as u16;
            exts.extend([0x00, 0x00]);
            exts.extend((n + 5).to_be_bytes());
            exts.extend((n + 3).to_be_bytes());
            exts.push(0);
            exts.extend(n.to_be_bytes());
            exts.extend(name.as_bytes());
        }
        let mut body = vec![0x03, 0x03];
        body.extend([7u8; 32]);
        body.push(0); // session id
        body.extend([0x00, 0x02, 0x13, 0x01]); // one suite
        body.extend([0x01, 0x00]); // null compression
        body.extend((exts.len() as u16).to_be_bytes());
        body.extend(exts);
        let mut hs = vec![1];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend((hs.len() as u16).to_be_bytes());
        rec.extend(hs);
        rec
    }

    #[test]
    fn sni_is_read_from_a_client_hello() {
        assert_eq!(tls_sni(&hello(Some("api.example.com"))).as_deref(), Some("api.example.com"));
        assert_eq!(tls_sni(&hello(None)), None);
        assert_eq!(tls_sni(b"GET / HTTP/1.1\r\n\r\n"), None);
        let full = hello(Some("a.test"));
        for cut in 0..full.len() {
            assert_eq!(tls_sni(&full[..cut]), None, "a record cut at {cut} names nothing");
        }
    }

    #[tokio::test]
    async fn first_record_waits_for_a_whole_tls_record() {
        let rec = hello(Some("a.test"));
        let (mut a, mut b) = tokio::io::duplex(64);
        let (head, tail) = rec.split_at(7);
        let (head, tail) = (head.to_vec(), tail.to_vec());
        let writer = tokio::spawn(async move {
            a.write_all(&head).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            a.write_all(&tail).await.unwrap();
            a.write_all(b"next").await.unwrap();
            a
        });
        let got = first_record(&mut b).await.unwrap();
        assert_eq!(&got[..rec.len()], &rec[..]);
        drop(writer.await.unwrap());
    }

    fn proxy(range: &str) -> Proxy {
        Proxy::new(DEFAULT_PORT, HashMap::new(), None, range.parse().unwrap(), None).unwrap()
    }

    #[tokio::test]
    async fn addresses_are_held_to_the_policy() {
        let p = proxy("10.213.0.0/16");
        let allow =
            |a: &[&str]| Policy::parse("allowlist", &a.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let open = Policy::parse("open", &[]).unwrap();
        let pol = allow(&["198.18.0.1:80", "169.254.169.254"]);
        assert!(p.destination(&pol, "198.18.0.1", 80).await.is_ok());
        assert_eq!(p.destination(&pol, "198.18.0.1", 443).await.unwrap_err().status, StatusCode::FORBIDDEN);
        assert_eq!(p.destination(&pol, "198.18.0.2", 80).await.unwrap_err().status, StatusCode::FORBIDDEN);
        assert!(p.destination(&pol, "169.254.169.254", 80).await.is_ok(), "listed: let through");
        assert!(p.destination(&open, "198.18.0.2", 80).await.is_ok());
        for refused in ["127.0.0.1", "169.254.169.254", "10.213.0.7", "0.0.0.0", "224.0.0.1"] {
            assert_eq!(p.destination(&open, refused, 80).await.unwrap_err().status, StatusCode::FORBIDDEN, "{refused}");
        }
        assert_eq!(p.destination(&open, "::1", 80).await.unwrap_err().status, StatusCode::FORBIDDEN);
        // A name not listed is refused before any lookup (there is no DNS here to ask).
        assert_eq!(p.destination(&pol, "other.test", 80).await.unwrap_err().status, StatusCode::FORBIDDEN);
        assert_eq!(
            p.destination(&allow(&["a.test"]), "a.test", 80).await.unwrap_err().status,
            StatusCode::BAD_GATEWAY,
            "listed, but no DNS upstream to resolve it"
        );
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = hyper::HeaderMap::new();
        for (k, v) in [
            ("connection", "close, x-private"),
            ("x-private", "1"),
            ("proxy-authorization", "Basic abc"),
            ("proxy-connection", "keep-alive"),
            ("accept", "*/*"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), vec!["accept"]);
    }

    #[test]
    fn credentials_are_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.json");
        std::fs::write(&f, r#"{"API.Example.com.": {"headers": {"Authorization": "Bearer k"}, "tls": true}}"#).unwrap();
        let c = load_credentials(&f).unwrap();
        assert!(c["api.example.com"].tls);
        std::fs::write(&f, r#"{"a": {"headers": {"Bad Name": "x"}}}"#).unwrap();
        assert!(load_credentials(&f).unwrap_err().to_string().contains("not a valid HTTP header"));
        std::fs::write(&f, r#"{"a": {"header": {}}}"#).unwrap();
        assert!(load_credentials(&f).unwrap_err().to_string().contains("JSON object"));
    }
}
