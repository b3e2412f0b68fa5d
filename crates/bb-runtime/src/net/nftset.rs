//! Elements added to the daemon's nftables sets over nfnetlink, from the daemon's process: a
//! sandbox's address entries and the answers of its allowed names reach its rules without an
//! `nft` run (a process start and a read of the whole ruleset, a few milliseconds each time).
//!
//! Only this one operation is spoken here; tables, chains and sets are made by `nft`. The sets
//! it fills are concatenations with `flags interval` (nftables' concatenated range sets):
//! `ipv4_addr . inet_service` ([`add`]) and `ipv4_addr . inet_proto` ([`add_everything`]); each
//! element is a key and a key end, each field of a key padded to 4 bytes. One batch
//! (`BATCH_BEGIN`, `NEWSETELEM`, `BATCH_END`), one acknowledgement.

use super::policy::Ports;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

// From <linux/netfilter/nf_tables.h>: attributes of NFT_MSG_NEWSETELEM.
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;
const NLA_F_NESTED: u16 = 1 << 15;
const NLMSG_HDRLEN: usize = 16;

/// Addresses `first..=last` on `ports`, for `timeout` seconds (`None`: until removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Element {
    pub first: Ipv4Addr,
    pub last: Ipv4Addr,
    pub ports: Ports,
    pub timeout: Option<u32>,
}

/// An element as the kernel takes it: its key, key end and timeout (s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Keyed {
    key: [u8; 8],
    end: [u8; 8],
    timeout: Option<u32>,
}

impl From<&Element> for Keyed {
    fn from(e: &Element) -> Keyed {
        Keyed { key: key(e.first, e.ports.low), end: key(e.last, e.ports.high), timeout: e.timeout }
    }
}

/// Add `elements` to set `set` (`ipv4_addr . inet_service`) of table `inet {table}` (present
/// ones are kept).
pub fn add(table: &str, set: &str, elements: &[Element]) -> io::Result<()> {
    let keyed: Vec<Keyed> = elements.iter().map(Keyed::from).collect();
    send_elements(table, set, &keyed)
}

/// Add every address on every protocol to set `set` (`ipv4_addr . inet_proto`) of table
/// `inet {table}`: `0.0.0.0/0 . 0-255`.
pub fn add_everything(table: &str, set: &str) -> io::Result<()> {
    let everything = Keyed { key: [0, 0, 0, 0, 0, 0, 0, 0], end: [255, 255, 255, 255, 255, 0, 0, 0], timeout: None };
    send_elements(table, set, &[everything])
}

fn send_elements(table: &str, set: &str, elements: &[Keyed]) -> io::Result<()> {
    use nix::sys::socket::{recv, send, socket, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
    if elements.is_empty() {
        return Ok(());
    }
    let fd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkNetFilter)?;
    let batch = batch(table, set, elements);
    send(fd.as_raw_fd(), &batch, MsgFlags::empty())?;
    let mut buf = vec![0u8; 8 << 10];
    loop {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        let mut at = 0;
        while at + NLMSG_HDRLEN <= n {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let ty = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2 bytes"));
            let seq = u32::from_ne_bytes(buf[at + 8..at + 12].try_into().expect("4 bytes"));
            if ty == libc::NLMSG_ERROR as u16 && seq == ELEM_SEQ && at + NLMSG_HDRLEN + 4 <= n {
                let code = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().expect("4 bytes"));
                return match code {
                    0 => Ok(()),
                    c => Err(io::Error::from_raw_os_error(-c)),
                };
            }
            if len < NLMSG_HDRLEN {
                break;
            }
            at += len.next_multiple_of(4);
        }
    }
}

/// The sequence numbers of the batch's three messages; the kernel answers the middle one.
const BEGIN_SEQ: u32 = 1;
const ELEM_SEQ: u32 = 2;
const END_SEQ: u32 = 3;

/// The batch that adds `elements` to `set` of `inet {table}`.
fn batch(table: &str, set: &str, elements: &[Keyed]) -> Vec<u8> {
    let subsys = libc::NFNL_SUBSYS_NFTABLES as u16;
    let request = libc::NLM_F_REQUEST as u16;
    let mut b = Vec::with_capacity(256 + elements.len() * 64);
    message(&mut b, libc::NFNL_MSG_BATCH_BEGIN as u16, request, BEGIN_SEQ, libc::AF_UNSPEC as u8, subsys, |_| {});
    let ty = (subsys << 8) | libc::NFT_MSG_NEWSETELEM as u16;
    let flags = request | libc::NLM_F_CREATE as u16 | libc::NLM_F_ACK as u16;
    message(&mut b, ty, flags, ELEM_SEQ, libc::NFPROTO_INET as u8, 0, |b| {
        attr(b, NFTA_SET_ELEM_LIST_TABLE, &strz(table));
        attr(b, NFTA_SET_ELEM_LIST_SET, &strz(set));
        nest(b, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
            for e in elements {
                nest(b, NFTA_LIST_ELEM, |b| {
                    nest(b, NFTA_SET_ELEM_KEY, |b| attr(b, NFTA_DATA_VALUE, &e.key));
                    nest(b, NFTA_SET_ELEM_KEY_END, |b| attr(b, NFTA_DATA_VALUE, &e.end));
                    if let Some(s) = e.timeout {
                        attr(b, NFTA_SET_ELEM_TIMEOUT, &(u64::from(s) * 1000).to_be_bytes());
                    }
                });
            }
        });
    });
    message(&mut b, libc::NFNL_MSG_BATCH_END as u16, request, END_SEQ, libc::AF_UNSPEC as u8, subsys, |_| {});
    b
}

/// The key `addr . port`: each field in network order, padded to 4 bytes.
fn key(addr: Ipv4Addr, port: u16) -> [u8; 8] {
    let (a, p) = (addr.octets(), port.to_be_bytes());
    [a[0], a[1], a[2], a[3], p[0], p[1], 0, 0]
}

fn strz(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// A netlink message: header, `nfgenmsg` (`family`, version 0, `res_id` big-endian), then
/// what `body` writes.
fn message(b: &mut Vec<u8>, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16, body: impl FnOnce(&mut Vec<u8>)) {
    let start = b.len();
    b.extend_from_slice(&[0; NLMSG_HDRLEN]);
    b.extend_from_slice(&[family, 0]);
    b.extend_from_slice(&res_id.to_be_bytes());
    body(b);
    let len = (b.len() - start) as u32;
    b[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    b[start + 4..start + 6].copy_from_slice(&ty.to_ne_bytes());
    b[start + 6..start + 8].copy_from_slice(&flags.to_ne_bytes());
    b[start + 8..start + 12].copy_from_slice(&seq.to_ne_bytes());
}

/// An attribute, padded to 4 bytes.
fn attr(b: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    b.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    b.extend_from_slice(&ty.to_ne_bytes());
    b.extend_from_slice(payload);
    b.resize(b.len().next_multiple_of(4), 0);
}

/// A nested attribute holding what `inner` writes.
fn nest(b: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let start = b.len();
    b.extend_from_slice(&[0; 4]);
    inner(b);
    let len = (b.len() - start) as u16;
    b[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    b[start + 2..start + 4].copy_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout `nft` itself sends for `add element inet t r7 { 10.0.0.0/8 . 443 }`.
    #[test]
    fn an_element_is_a_padded_key_and_key_end() {
        let e = Element {
            first: Ipv4Addr::new(10, 0, 0, 0),
            last: Ipv4Addr::new(10, 255, 255, 255),
            ports: Ports { low: 443, high: 443 },
            timeout: Some(60),
        };
        let b = batch("t", "r7", &[Keyed::from(&e)]);
        // Three messages, each as long as its header says, the middle one the elements.
        let len = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        let (first, second) = (len(0), len(len(0)));
        assert_eq!(first + second + len(first + second), b.len());
        let elem = &b[first..first + second];
        assert_eq!(u16::from_ne_bytes(elem[4..6].try_into().unwrap()), (10 << 8) | 12);
        let find = |needle: &[u8]| elem.windows(needle.len()).any(|w| w == needle);
        assert!(find(&[10, 0, 0, 0, 0x01, 0xbb, 0, 0]), "key 10.0.0.0 . 443");
        assert!(find(&[10, 255, 255, 255, 0x01, 0xbb, 0, 0]), "key end 10.255.255.255 . 443");
        assert!(find(&60_000u64.to_be_bytes()), "timeout in ms, big-endian");
        assert!(find(b"r7\0\0") && find(b"t\0\0\0"), "names NUL-terminated, padded");
    }
}
