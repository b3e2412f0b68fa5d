//! A sandbox's veth, address and default route over rtnetlink, in the daemon's process: no
//! `ip` is run on a create's path (each run of it costs a few milliseconds of process start;
//! the kernel's own work for a veth is about one).
//!
//! Messages are built and parsed by `netlink-packet-route`; the sockets come from `nix` (the
//! host's) and `bb_sys::ns::rtnetlink_socket_in` (one made inside a sandbox's namespace, which
//! it keeps).

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoBridgePort, InfoData, InfoKind, InfoPortData, InfoPortKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo,
    LinkMessage,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// The main routing table.
const RT_TABLE_MAIN: u8 = 254;

/// An rtnetlink socket and its requests' sequence numbers.
pub struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

impl Rtnl {
    /// A socket in the daemon's own network namespace.
    pub fn host() -> io::Result<Rtnl> {
        use nix::sys::socket::{socket, AddressFamily as Af, SockFlag, SockProtocol, SockType};
        let fd = socket(Af::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkRoute)?;
        Ok(Rtnl { fd, seq: 0 })
    }

    /// A socket in the network namespace at `netns` (e.g. `/proc/<pid>/ns/net`).
    pub fn in_netns(netns: &Path) -> io::Result<Rtnl> {
        let fd = bb_sys::ns::rtnetlink_socket_in(netns).map_err(|e| io::Error::new(e.source.kind(), e.to_string()))?;
        Ok(Rtnl { fd, seq: 0 })
    }

    /// Send `msg` and wait for the kernel's answer to it: on its acknowledgement the message
    /// it answered with, if any; its error otherwise.
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<Option<RouteNetlinkMessage>> {
        use nix::sys::socket::{recv, send, MsgFlags};
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        packet.finalize();
        let mut out = vec![0; packet.buffer_len()];
        packet.serialize(&mut out);
        send(self.fd.as_raw_fd(), &out, MsgFlags::empty())?;
        let mut buf = vec![0u8; 16 << 10];
        let mut answer = None;
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            let mut at = 0;
            while at < n {
                let len = NetlinkBuffer::new_checked(&buf[at..n]).map_err(io::Error::other)?.length() as usize;
                let reply =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..n]).map_err(io::Error::other)?;
                if reply.header.sequence_number == self.seq {
                    match reply.payload {
                        NetlinkPayload::Error(e) if e.code.is_none() => return Ok(answer),
                        NetlinkPayload::Error(e) => return Err(e.to_io()),
                        NetlinkPayload::InnerMessage(m) => answer = Some(m),
                        _ => {}
                    }
                }
                at += len.max(1).next_multiple_of(4);
            }
        }
    }

    /// A veth pair: `host_if` here, a port of bridge `bridge` (index), and `eth0` in the
    /// network namespace of process `pid`. Both down.
    pub fn add_veth(&mut self, host_if: &str, bridge: u32, pid: i32) -> io::Result<()> {
        let mut peer = LinkMessage::default();
        peer.attributes = vec![LinkAttribute::IfName("eth0".into()), LinkAttribute::NetNsPid(pid as u32)];
        let mut m = LinkMessage::default();
        m.attributes = vec![
            LinkAttribute::IfName(host_if.into()),
            LinkAttribute::Controller(bridge),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
            ]),
        ];
        self.request(RouteNetlinkMessage::NewLink(m), NLM_F_CREATE | NLM_F_EXCL).map(drop)
    }

    /// The index of link `name` in this socket's namespace.
    fn index(&mut self, name: &str) -> io::Result<u32> {
        let mut m = LinkMessage::default();
        m.attributes = vec![LinkAttribute::IfName(name.into())];
        match self.request(RouteNetlinkMessage::GetLink(m), 0)? {
            Some(RouteNetlinkMessage::NewLink(l)) => Ok(l.header.index),
            _ => Err(io::Error::other(format!("the kernel did not describe link {name}"))),
        }
    }

    /// Bridge port `host_if`: isolated (it reaches no other isolated port) and up.
    pub fn isolate_port_up(&mut self, host_if: &str) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        m.attributes = vec![
            LinkAttribute::IfName(host_if.into()),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::PortKind(InfoPortKind::Bridge),
                LinkInfo::PortData(InfoPortData::BridgePort(vec![InfoBridgePort::Isolated(true)])),
            ]),
        ];
        self.request(RouteNetlinkMessage::NewLink(m), 0).map(drop)
    }

    /// In a sandbox's namespace: `eth0` gets `addr/prefix` and goes up, the default route goes
    /// via `gateway`.
    pub fn address_eth0(&mut self, addr: Ipv4Addr, prefix: u8, gateway: Ipv4Addr) -> io::Result<()> {
        let eth0 = self.index("eth0")?;
        let mut a = AddressMessage::default();
        a.header.family = AddressFamily::Inet;
        a.header.prefix_len = prefix;
        a.header.index = eth0;
        a.attributes = vec![AddressAttribute::Local(addr.into()), AddressAttribute::Address(addr.into())];
        self.request(RouteNetlinkMessage::NewAddress(a), NLM_F_CREATE | NLM_F_EXCL)?;
        let mut up = LinkMessage::default();
        up.header.index = eth0;
        up.header.flags = LinkFlags::Up;
        up.header.change_mask = LinkFlags::Up;
        self.request(RouteNetlinkMessage::NewLink(up), 0)?;
        let mut r = RouteMessage::default();
        r.header.address_family = AddressFamily::Inet;
        r.header.table = RT_TABLE_MAIN;
        r.header.protocol = RouteProtocol::Boot;
        r.header.scope = RouteScope::Universe;
        r.header.kind = RouteType::Unicast;
        r.attributes = vec![RouteAttribute::Gateway(RouteAddress::Inet(gateway))];
        self.request(RouteNetlinkMessage::NewRoute(r), NLM_F_CREATE | NLM_F_EXCL).map(drop)
    }

    /// Remove link `name` (a veth takes its peer with it).
    pub fn delete(&mut self, name: &str) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.attributes = vec![LinkAttribute::IfName(name.into())];
        self.request(RouteNetlinkMessage::DelLink(m), 0).map(drop)
    }
}

/// The index of link `name` in the daemon's namespace.
pub fn index(name: &str) -> io::Result<u32> {
    Ok(nix::net::if_::if_nametoindex(name)?)
}
