//! The host side of sandbox egress: one bridge, one veth per sandbox with egress, and one
//! nftables table. The bridge is made with `ip`, the veths over rtnetlink ([`super::link`]),
//! the rules with `nft`; chains can be made ahead of their sandboxes ([`Fabric::prepare`]).
//!
//! ```text
//!  sandbox netns            host netns
//!  eth0 10.213.0.N  ──veth──  {bridge}vN (bridge port, isolated: no port reaches another)
//!                              {bridge} 10.213.0.1 (gateway; the daemon's DNS on :53)
//!                              nftables table inet branchbox_{bridge}:
//!                                input:   from the bridge only DNS to the gateway (the
//!                                         host's other addresses refuse: a reset)
//!                                forward: into the bridge only replies; out of it by the
//!                                         sandbox's chain (a verdict map on its address)
//!                                nat:     any DNS from the bridge goes to the gateway;
//!                                         masquerade what leaves
//! ```
//!
//! A sandbox's chain `sN` accepts its listed address entries (set `rN`), refuses the addresses
//! no sandbox may reach unless listed (set `blocked`: loopback, link-local/metadata, this
//! range, multicast), accepts the addresses its allowed names resolved to (set `dN`, filled by
//! the daemon's DNS with the answers' TTL; mode `allowlist`) and what set `oN` holds (every
//! address on every protocol in mode `open`, nothing otherwise), and refuses the rest (TCP with
//! a reset, so the caller learns at once). The mode is in the sets, not the rules: a chain made
//! ahead takes any mode with elements alone. A policy change replaces the chain's rules and
//! sets in one nftables transaction.

use super::policy::{Limits, Mode, Policy, Ports};
use super::{link, nftset};
use ipnet::Ipv4Net;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum FabricError {
    #[error("running {tool}: {source} (install iproute2 and nftables: `apt-get install iproute2 nftables`)")]
    Spawn {
        tool: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed ({what}): {stderr}")]
    Failed { tool: &'static str, what: String, stderr: String },
    #[error("a thread running nft panicked")]
    Panicked,
    #[error("network link ({what}): {source}")]
    Link {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("nftables set ({what}): {source}")]
    Set {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("enabling IPv4 forwarding: {0}")]
    Forwarding(#[source] std::io::Error),
}

/// Addresses no sandbox reaches unless an allow entry lists them (besides the sandboxes' own
/// range, added per fabric).
const BLOCKED: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];

/// The bridge and table of one daemon.
#[derive(Debug, Clone)]
pub struct Fabric {
    pub bridge: String,
    pub range: Ipv4Net,
    pub table: String,
}

impl Fabric {
    pub fn new(bridge: &str, range: Ipv4Net) -> Fabric {
        Fabric { bridge: bridge.to_string(), range: range.trunc(), table: format!("branchbox_{bridge}") }
    }

    /// The gateway: the bridge's address (the range's first host).
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.range.network()) + 1)
    }

    /// The address of slot `n` (2 and up).
    pub fn address(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.range.network()) + n)
    }

    /// How many slots the range has (the network, gateway and broadcast addresses excluded).
    pub fn slots(&self) -> u32 {
        (1u32 << (32 - self.range.prefix_len())).saturating_sub(3)
    }

    /// The host-side veth of slot `n`.
    pub fn host_if(&self, n: u32) -> String {
        format!("{}v{n}", self.bridge)
    }

    /// Make the bridge (kept if there) and the table (made afresh), and turn forwarding on.
    pub fn up(&self) -> Result<(), FabricError> {
        let (br, gw, len) = (&self.bridge, self.gateway(), self.range.prefix_len());
        if !std::path::Path::new("/sys/class/net").join(br).exists() {
            run("ip", &["link", "add", br, "type", "bridge"], None, "make the bridge")?;
        }
        // A MAC of its own: left to the kernel, a bridge takes its lowest port's, so a veth
        // joining or leaving would change the gateway's MAC under every sandbox's ARP cache
        // (their traffic then goes nowhere until it expires).
        let batch =
            format!("link set {br} address {}\naddr replace {gw}/{len} dev {br}\nlink set {br} up\n", bridge_mac(gw));
        run("ip", &["-batch", "-"], Some(&batch), "address the bridge")?;
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(FabricError::Forwarding)?;
        run("nft", &["-f", "-"], Some(&self.table_script()), "make the table")?;
        Ok(())
    }

    /// Remove the table and the bridge (the daemon's sandboxes with egress are gone).
    pub fn down(&self) -> Result<(), FabricError> {
        run("nft", &["delete", "table", "inet", &self.table], None, "remove the table")?;
        run("ip", &["link", "del", &self.bridge], None, "remove the bridge")?;
        Ok(())
    }

    fn table_script(&self) -> String {
        let (t, br, gw, range) = (&self.table, &self.bridge, self.gateway(), self.range);
        let blocked = BLOCKED.iter().copied().chain([range.to_string().as_str()]).collect::<Vec<_>>().join(", ");
        format!(
            "table inet {t}\ndelete table inet {t}\n\
table inet {t} {{
  map sandboxes {{ type ipv4_addr : verdict; }}
  set blocked {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {blocked} }} }}
  chain input {{ type filter hook input priority filter - 5; policy accept;
    iifname \"{br}\" ct state established,related accept
    iifname \"{br}\" ip daddr {gw} udp dport 53 accept
    iifname \"{br}\" meta l4proto tcp reject with tcp reset
    iifname \"{br}\" reject with icmpx admin-prohibited
  }}
  chain forward {{ type filter hook forward priority filter - 5; policy accept;
    oifname \"{br}\" ct state established,related accept
    oifname \"{br}\" drop
    iifname \"{br}\" ct state established,related accept
    iifname \"{br}\" meta nfproto ipv4 ip saddr vmap @sandboxes
    iifname \"{br}\" drop
  }}
  chain dns {{ type nat hook prerouting priority dstnat; policy accept;
    iifname \"{br}\" meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gw}:53
  }}
  chain egress {{ type nat hook postrouting priority srcnat; policy accept;
    ip saddr {range} oifname != \"{br}\" masquerade
  }}
}}
"
        )
    }

    /// Make the chains of `slots` ahead of their sandboxes, in the [`parked`] shape (nothing is
    /// reached but what the daemon's DNS lets through): a sandbox wired on one of them whose
    /// chain would be the same (mode `allowlist` with names only) runs no `nft`.
    pub fn prepare(&self, slots: &[u32]) -> Result<(), FabricError> {
        let parked = parked();
        let script: String = slots.iter().map(|&n| self.chain_script(n, &parked, true)).collect();
        run("nft", &["-f", "-"], Some(&script), "make sandboxes' rules ahead")
    }

    /// Wire slot `n` into the network namespace of process `pid` as `eth0`, and give it
    /// `policy`'s chain (`prepared`: [`Fabric::prepare`] made it, in the parked shape).
    pub fn attach(&self, n: u32, pid: i32, policy: &Policy, prepared: bool) -> Result<(), FabricError> {
        let hif = self.host_if(n);
        // A veth left by a crash (its sandbox's init alive, unknown to this daemon) holds the name.
        if std::path::Path::new("/sys/class/net").join(&hif).exists() {
            let _ = link::Rtnl::host().and_then(|mut h| h.delete(&hif));
        }
        let rules = self.rules(n, policy, prepared);
        // The rules are keyed by address, not by interface: made beside the links.
        let t0 = std::time::Instant::now();
        let (rules, links) = std::thread::scope(|scope| {
            let rules = scope.spawn(|| {
                let r = self.apply(n, rules);
                (r, t0.elapsed())
            });
            let links = self.wire(n, pid).and_then(|()| self.limit_bandwidth(n, pid, &policy.limits));
            let t_links = t0.elapsed();
            let (rules, t_rules) = rules.join().map_or((Err(FabricError::Panicked), None), |(r, t)| (r, Some(t)));
            tracing::debug!(slot = n, prepared, ?t_links, ?t_rules, "sandbox wired");
            (rules, links)
        });
        match (rules, links) {
            (Ok(()), Ok(())) => Ok(()),
            (rules, links) => {
                if rules.is_ok() {
                    let _ = run("nft", &["-f", "-"], Some(&self.unchain_script(n)), "");
                }
                let _ = link::Rtnl::host().and_then(|mut h| h.delete(&hif));
                links.and(rules)
            }
        }
    }

    /// What gives slot `n` `policy`'s chain (`prepared`: made ahead, parked).
    fn rules(&self, n: u32, policy: &Policy, prepared: bool) -> Rules {
        let shape = Policy { rules: Vec::new(), mode: Mode::Allowlist, ..policy.clone() };
        if !prepared {
            Rules::Script(self.chain_script(n, policy, true))
        } else if self.chain_script(n, &shape, false) == self.chain_script(n, &parked(), false) {
            // The chain made ahead is the policy's but for its sets' elements.
            Rules::Elements { listed: net_elements(policy), open: policy.mode == Mode::Open }
        } else {
            Rules::Script(self.update_script(n, policy, &parked()))
        }
    }

    /// Give slot `n`, wired with the [`parked`] chain, `policy` (with egress) instead: its
    /// address entries alone, or the chain's replacement, and its bandwidth.
    pub fn assign(&self, n: u32, pid: i32, policy: &Policy) -> Result<(), FabricError> {
        self.apply(n, self.rules(n, policy, true))?;
        self.limit_bandwidth(n, pid, &policy.limits)
    }

    /// A new wiring's bandwidth limit, if `limits` has one.
    fn limit_bandwidth(&self, n: u32, pid: i32, limits: &Limits) -> Result<(), FabricError> {
        match limits.bandwidth_mbps {
            Some(_) => self.shape(n, pid, limits),
            None => Ok(()),
        }
    }

    fn apply(&self, n: u32, rules: Rules) -> Result<(), FabricError> {
        match rules {
            Rules::Script(script) => run("nft", &["-f", "-"], Some(&script), "add the sandbox's rules"),
            Rules::Elements { listed, open } => {
                nftset::add(&self.table, &format!("r{n}"), &listed)
                    .map_err(|source| FabricError::Set { what: "add the sandbox's address entries", source })?;
                if open {
                    nftset::add_everything(&self.table, &format!("o{n}"))
                        .map_err(|source| FabricError::Set { what: "open the sandbox's egress", source })?;
                }
                Ok(())
            }
        }
    }

    /// Slot `n`'s veth: its host side an isolated port of the bridge, `eth0` in the namespace
    /// of `pid` with the slot's address and the default route via the gateway.
    fn wire(&self, n: u32, pid: i32) -> Result<(), FabricError> {
        let err = |what| move |source| FabricError::Link { what, source };
        let hif = self.host_if(n);
        let bridge = link::index(&self.bridge).map_err(err("find the bridge"))?;
        let mut host = link::Rtnl::host().map_err(err("open rtnetlink"))?;
        host.add_veth(&hif, bridge, pid).map_err(err("make the sandbox's veth"))?;
        host.isolate_port_up(&hif).map_err(err("set the sandbox's veth up"))?;
        let netns = format!("/proc/{pid}/ns/net");
        let mut inside =
            link::Rtnl::in_netns(std::path::Path::new(&netns)).map_err(err("enter the sandbox's netns"))?;
        inside
            .address_eth0(self.address(n), self.range.prefix_len(), self.gateway())
            .map_err(err("address the sandbox's eth0"))
    }

    /// Slot `n`'s rules again (a daemon restart made the table afresh; the veth lived on).
    pub fn restore(&self, n: u32, policy: &Policy) -> Result<(), FabricError> {
        run("nft", &["-f", "-"], Some(&self.chain_script(n, policy, true)), "restore the sandbox's rules")
    }

    /// Replace slot `n`'s rules with `policy`'s (one transaction).
    /// The connection count restarts when the cap changes from `was`'s (each counted
    /// connection holds the cap it was counted under), so a new cap counts the connections made
    /// from then on.
    pub fn update(&self, n: u32, policy: &Policy, was: &Policy) -> Result<(), FabricError> {
        run("nft", &["-f", "-"], Some(&self.update_script(n, policy, was)), "change the sandbox's rules")
    }

    fn update_script(&self, n: u32, policy: &Policy, was: &Policy) -> String {
        let mut script = self.chain_script(n, policy, false);
        if policy.limits.max_connections != was.limits.max_connections {
            script.insert_str(0, &format!("flush set inet {} c{n}\n", self.table));
        }
        script
    }

    /// Give slot `n` (its sandbox's init `pid`) the bandwidth of `limits`, each way: a token
    /// bucket on the host side of its veth (what reaches the sandbox) and on its `eth0` (what
    /// leaves it; the sandbox holds no CAP_NET_ADMIN to lift it). No bandwidth: both removed.
    pub fn shape(&self, n: u32, pid: i32, limits: &Limits) -> Result<(), FabricError> {
        let (hif, ns) = (self.host_if(n), format!("--net=/proc/{pid}/ns/net"));
        let Some(line) = limits.bandwidth_mbps.map(tbf) else {
            // Absent already is fine.
            let _ = run("tc", &["qdisc", "del", "dev", &hif, "root"], None, "");
            let _ = run("nsenter", &[&ns, "tc", "qdisc", "del", "dev", "eth0", "root"], None, "");
            return Ok(());
        };
        let what = "limit the sandbox's bandwidth";
        run("tc", &["-batch", "-"], Some(&format!("qdisc replace dev {hif} {line}")), what)?;
        run("nsenter", &[&ns, "tc", "-batch", "-"], Some(&format!("qdisc replace dev eth0 {line}")), what)
    }

    /// Remove slot `n`: its veth (the sandbox's eth0 goes with it) and its rules.
    pub fn detach(&self, n: u32) -> Result<(), FabricError> {
        let rules = run("nft", &["-f", "-"], Some(&self.unchain_script(n)), "remove the sandbox's rules");
        let link = link::Rtnl::host()
            .and_then(|mut h| h.delete(&self.host_if(n)))
            .map_err(|source| FabricError::Link { what: "remove the sandbox's veth", source });
        rules.and(link)
    }

    /// Removes slot `n`'s chain, sets and map element.
    fn unchain_script(&self, n: u32) -> String {
        let t = &self.table;
        format!(
            "delete element inet {t} sandboxes {{ {ip} }}\nflush chain inet {t} s{n}\ndelete chain inet {t} s{n}\n\
             delete set inet {t} r{n}\ndelete set inet {t} d{n}\ndelete set inet {t} c{n}\ndelete set inet {t} o{n}\n",
            ip = self.address(n)
        )
    }

    /// The chain of slot `n` for `policy`; `new`: the chain and sets are made (else flushed).
    fn chain_script(&self, n: u32, policy: &Policy, new: bool) -> String {
        let (t, ip) = (&self.table, self.address(n));
        let mut s = String::new();
        if new {
            let _ = writeln!(s, "add set inet {t} r{n} {{ type ipv4_addr . inet_service; flags interval; }}");
            let _ = writeln!(s, "add set inet {t} d{n} {{ type ipv4_addr . inet_service; flags interval, timeout; }}");
            let _ = writeln!(s, "add set inet {t} c{n} {{ type ipv4_addr; size 16; flags dynamic; }}");
            let _ = writeln!(s, "add set inet {t} o{n} {{ type ipv4_addr . inet_proto; flags interval; }}");
            let _ = writeln!(s, "add chain inet {t} s{n}");
        } else {
            let _ = writeln!(
                s,
                "flush chain inet {t} s{n}\nflush set inet {t} r{n}\nflush set inet {t} d{n}\nflush set inet {t} o{n}"
            );
        }
        // The connection cap first: a new connection past it is reset whatever its address.
        // (Its set is kept across other changes: the connections open stay counted.)
        if let Some(m) = policy.limits.max_connections {
            let _ = writeln!(
                s,
                "add rule inet {t} s{n} meta l4proto tcp ct state new add @c{n} {{ ip saddr ct count over {m} }} \
                 reject with tcp reset"
            );
        }
        s.extend(self.nets_element(n, policy));
        let _ = writeln!(s, "add rule inet {t} s{n} meta l4proto {{ tcp, udp }} ip daddr . th dport @r{n} accept");
        let _ = writeln!(s, "add rule inet {t} s{n} ip daddr @blocked meta l4proto tcp reject with tcp reset");
        let _ = writeln!(s, "add rule inet {t} s{n} ip daddr @blocked reject with icmpx admin-prohibited");
        let _ = writeln!(s, "add rule inet {t} s{n} meta l4proto {{ tcp, udp }} ip daddr . th dport @d{n} accept");
        let _ = writeln!(s, "add rule inet {t} s{n} ip daddr . meta l4proto @o{n} accept");
        if policy.mode == Mode::Open {
            let _ = writeln!(s, "add element inet {t} o{n} {{ 0.0.0.0/0 . 0-255 }}");
        }
        let _ = writeln!(s, "add rule inet {t} s{n} meta l4proto tcp reject with tcp reset");
        let _ = writeln!(s, "add rule inet {t} s{n} reject with icmpx admin-prohibited");
        if new {
            let _ = writeln!(s, "add element inet {t} sandboxes {{ {ip} : jump s{n} }}");
        }
        s
    }

    /// The address entries of `policy` into slot `n`'s set `rN` (none: `None`).
    fn nets_element(&self, n: u32, policy: &Policy) -> Option<String> {
        let nets: Vec<String> = policy.nets().map(|(net, p)| format!("{net} . {}", p.nft())).collect();
        (!nets.is_empty()).then(|| format!("add element inet {} r{n} {{ {} }}\n", self.table, nets.join(", ")))
    }

    /// Let slot `n` reach `addrs` on `ports` for `ttl` seconds (an allowed name's answer).
    pub fn allow_answers(&self, n: u32, addrs: &[Ipv4Addr], ports: &[Ports], ttl: u32) -> Result<(), FabricError> {
        if addrs.is_empty() || ports.is_empty() {
            return Ok(());
        }
        let elements: Vec<nftset::Element> = addrs
            .iter()
            .flat_map(|&a| {
                ports.iter().map(move |&ports| nftset::Element { first: a, last: a, ports, timeout: Some(ttl) })
            })
            .collect();
        nftset::add(&self.table, &format!("d{n}"), &elements)
            .map_err(|source| FabricError::Set { what: "let the sandbox reach a name's addresses", source })
    }
}

/// What gives a slot its policy's chain.
#[derive(Debug, PartialEq)]
enum Rules {
    /// An `nft` script.
    Script(String),
    /// Elements alone: `listed` into its set `rN` (none: nothing), and with `open` every
    /// address on every protocol into its set `oN`.
    Elements { listed: Vec<nftset::Element>, open: bool },
}

/// `policy`'s address entries as elements of a set.
fn net_elements(policy: &Policy) -> Vec<nftset::Element> {
    policy
        .nets()
        .map(|(net, ports)| nftset::Element { first: net.network(), last: net.broadcast(), ports, timeout: None })
        .collect()
}

/// The policy of a chain made ahead ([`Fabric::prepare`]): mode `allowlist`, nothing listed.
pub fn parked() -> Policy {
    Policy { mode: Mode::Allowlist, ..Policy::none() }
}

/// The bridge's MAC: locally administered, unicast, from its gateway address (one per range).
fn bridge_mac(gw: Ipv4Addr) -> String {
    let [a, b, c, d] = gw.octets();
    format!("02:62:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// A token bucket qdisc of `mbps` (`root tbf ...`): bursts of 20 ms, at least 64 KiB.
fn tbf(mbps: f64) -> String {
    let kbit = (mbps * 1000.0).round().max(1.0) as u64;
    let burst = (kbit * 1000 / 8 / 50).max(64 << 10);
    format!("root tbf rate {kbit}kbit burst {burst} latency 50ms\n")
}

/// Bytes (received, sent) by the sandbox whose veth's host side is `host_if` (which counts them
/// the other way round).
pub fn counters(host_if: &str) -> (u64, u64) {
    let stat = |f: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{host_if}/statistics/{f}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    (stat("tx_bytes"), stat("rx_bytes"))
}

/// Run `tool args` with `stdin`; its stderr becomes the error.
fn run(tool: &'static str, args: &[&str], stdin: Option<&str>, what: &str) -> Result<(), FabricError> {
    let mut child = Command::new(tool)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| FabricError::Spawn { tool, source })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child.wait_with_output().map_err(|source| FabricError::Spawn { tool, source })?;
    if out.status.success() {
        return Ok(());
    }
    Err(FabricError::Failed {
        tool,
        what: what.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().chars().take(2000).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fabric() -> Fabric {
        Fabric::new("bbt0", "10.213.0.0/24".parse().unwrap())
    }

    #[test]
    fn the_bridge_has_a_fixed_local_unicast_mac() {
        assert_eq!(bridge_mac(Ipv4Addr::new(10, 213, 0, 1)), "02:62:0a:d5:00:01");
        let first = u8::from_str_radix(&bridge_mac(Ipv4Addr::new(10, 231, 0, 1))[..2], 16).unwrap();
        assert!(first & 0x02 != 0 && first & 0x01 == 0, "locally administered, unicast");
    }

    #[test]
    fn slots_addresses_and_names() {
        let f = fabric();
        assert_eq!(f.gateway(), Ipv4Addr::new(10, 213, 0, 1));
        assert_eq!(f.address(2), Ipv4Addr::new(10, 213, 0, 2));
        assert_eq!(f.slots(), 253);
        assert_eq!(f.host_if(17), "bbt0v17");
        assert_eq!(f.table, "branchbox_bbt0");
    }

    #[test]
    fn chains_follow_the_mode() {
        let f = fabric();
        let allow = Policy::parse("allowlist", &["10.0.0.0/8:443".into(), "a.test".into()]).unwrap();
        let s = f.chain_script(5, &allow, true);
        assert!(s.contains("add element inet branchbox_bbt0 r5 { 10.0.0.0/8 . 443 }"), "{s}");
        assert!(s.contains("@d5 accept") && s.contains("ip daddr . meta l4proto @o5 accept"), "{s}");
        assert!(!s.contains("add element inet branchbox_bbt0 o5"), "{s}");
        assert!(s.contains("sandboxes { 10.213.0.5 : jump s5 }"));
        let open = Policy::parse("open", &[]).unwrap();
        let s = f.chain_script(5, &open, false);
        assert!(s.contains("flush chain inet branchbox_bbt0 s5") && s.contains("flush set inet branchbox_bbt0 o5"));
        assert!(s.contains("add element inet branchbox_bbt0 o5 { 0.0.0.0/0 . 0-255 }"), "{s}");
        assert!(!s.contains("s5 accept\n") && !s.contains("jump s5"), "{s}");
        // Blocked addresses are refused before the mode's verdict, listed ones accepted first.
        let (r, b, o) = (s.find("@r5 accept").unwrap(), s.find("@blocked").unwrap(), s.find("@o5 accept").unwrap());
        assert!(r < b && b < o);
        // The rules are the same whatever the mode: only the sets' elements differ.
        let rules = |s: &str| s.lines().filter(|l| l.starts_with("add rule")).collect::<Vec<_>>().join("\n");
        let none = Policy::parse("allowlist", &[]).unwrap();
        assert_eq!(rules(&f.chain_script(5, &open, true)), rules(&f.chain_script(5, &none, true)));
    }

    #[test]
    fn a_chain_made_ahead_is_changed_only_where_the_policy_differs() {
        let f = fabric();
        let p = |mode, allow: &[&str]| Policy::parse(mode, &allow.iter().map(|a| a.to_string()).collect::<Vec<_>>());
        // Not made ahead: the whole chain.
        let names = p("allowlist", &["a.test", "*.b.test"]).unwrap();
        let script = |r| match r {
            Rules::Script(s) => s,
            other => panic!("not a script: {other:?}"),
        };
        assert!(script(f.rules(7, &names, false)).contains("add chain inet branchbox_bbt0 s7"));
        // Names alone: the parked chain is theirs (the DNS fills d7).
        assert_eq!(f.rules(7, &names, true), Rules::Elements { listed: Vec::new(), open: false });
        // Address entries: their elements only.
        let nets = p("allowlist", &["a.test", "10.0.0.0/8:443"]).unwrap();
        let ten = nftset::Element {
            first: Ipv4Addr::new(10, 0, 0, 0),
            last: Ipv4Addr::new(10, 255, 255, 255),
            ports: Ports { low: 443, high: 443 },
            timeout: None,
        };
        assert_eq!(f.rules(7, &nets, true), Rules::Elements { listed: vec![ten], open: false });
        // Mode open: its set's one element (and its address entries).
        let open = p("open", &["10.0.0.0/8:443"]).unwrap();
        assert_eq!(f.rules(7, &open, true), Rules::Elements { listed: vec![ten], open: true });
        // A connection cap: the chain is replaced.
        let capped = names.clone().with_limits(Limits { max_connections: Some(4), bandwidth_mbps: None }).unwrap();
        let capped = script(f.rules(7, &capped, true));
        assert!(capped.contains("flush set inet branchbox_bbt0 c7") && capped.contains("ct count over 4"), "{capped}");
    }

    #[test]
    fn the_table_blocks_its_own_range() {
        let s = fabric().table_script();
        assert!(s.contains("10.213.0.0/24 }"), "{s}");
        assert!(s.contains("169.254.0.0/16"));
        assert!(s.contains("dnat ip to 10.213.0.1:53"));
    }
}
