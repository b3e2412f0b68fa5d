//! A sandbox's network policy: its mode and its allow entries, parsed and checked.
//!
//! Entries (`allow`): a domain name (`api.example.com`), a wildcard (`*.example.org`: any name
//! below it, not the name itself), an address or CIDR (`10.0.0.5`, `10.0.0.0/8`); each with an
//! optional `:port` or `:low-high`. Names are allowed through the daemon's DNS: the addresses
//! an allowed name resolves to are let through (for the entry's ports) until the answer's TTL
//! runs out. Addresses and CIDRs are let through as listed, even the ones mode `open` refuses
//! (the host's link-local/metadata ranges): listing one is how it is let through.

use ipnet::Ipv4Net;
use std::net::Ipv4Addr;
use thiserror::Error;

/// Most entries in one sandbox's allowlist.
pub const MAX_ALLOW: usize = 256;

/// How a sandbox reaches the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Loopback only (no interface but `lo`).
    None,
    /// Only what `allow` lists.
    Allowlist,
    /// Anything but the host, the daemon, other sandboxes and link-local/metadata addresses
    /// (unless listed in `allow`).
    Open,
}

impl Mode {
    pub fn parse(s: &str) -> Result<Mode, PolicyError> {
        match s {
            "none" => Ok(Mode::None),
            "allowlist" => Ok(Mode::Allowlist),
            "open" => Ok(Mode::Open),
            _ => Err(PolicyError::Mode(s.to_string())),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Allowlist => "allowlist",
            Mode::Open => "open",
        }
    }
}

/// Ports an entry covers (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub low: u16,
    pub high: u16,
}

impl Ports {
    pub const ALL: Ports = Ports { low: 1, high: 65535 };

    /// nftables' form: `443` or `1-65535`.
    pub fn nft(self) -> String {
        if self.low == self.high {
            self.low.to_string()
        } else {
            format!("{}-{}", self.low, self.high)
        }
    }
}

/// What an entry names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A name, exactly (lower case, no trailing dot).
    Name(String),
    /// Any name below this suffix (`*.example.org` holds `example.org`).
    Below(String),
    Net(Ipv4Net),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub target: Target,
    pub ports: Ports,
}

/// Caps on a sandbox's traffic: on its `eth0` (modes with egress); the connection cap holds on
/// its proxy connections too.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Most TCP connections it may have open at once (a new one past it is reset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Bandwidth each way, megabits per second (past it, packets wait or are dropped, and TCP
    /// slows down).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_mbps: Option<f64>,
}

/// Largest `max_connections`.
pub const MAX_CONNECTIONS_SETTING: u32 = 65536;
/// Bounds of `bandwidth_mbps`.
pub const BANDWIDTH_MBPS: (f64, f64) = (0.1, 100_000.0);

impl Limits {
    pub fn is_none(&self) -> bool {
        *self == Limits::default()
    }

    pub fn check(&self) -> Result<(), PolicyError> {
        if let Some(m) = self.max_connections {
            if !(1..=MAX_CONNECTIONS_SETTING).contains(&m) {
                return Err(PolicyError::Limit(format!(
                    "max_connections must be from 1 to {MAX_CONNECTIONS_SETTING}; got {m}"
                )));
            }
        }
        if let Some(b) = self.bandwidth_mbps {
            let (lo, hi) = BANDWIDTH_MBPS;
            if !(b.is_finite() && (lo..=hi).contains(&b)) {
                return Err(PolicyError::Limit(format!("bandwidth_mbps must be from {lo} to {hi}; got {b}")));
            }
        }
        Ok(())
    }
}

/// A sandbox's mode and allow entries, as given (for the API) and parsed, and its limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub mode: Mode,
    pub allow: Vec<String>,
    pub rules: Vec<Rule>,
    pub limits: Limits,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("network mode {0:?} is unknown: use \"none\" (loopback only), \"allowlist\" or \"open\"")]
    Mode(String),
    #[error("allow entry {entry:?}: {why}")]
    Entry { entry: String, why: &'static str },
    #[error("{0} allow entries; at most {MAX_ALLOW}")]
    TooMany(usize),
    #[error(
        "network mode \"none\" takes no allow entries: use \"allowlist\" (or \"open\") to let traffic out, \
         or turn the daemon's proxy on (proxy: true) to let requests to them out through it"
    )]
    NoneWithAllow,
    #[error("network limits: {0}")]
    Limit(String),
}

impl Policy {
    pub fn none() -> Policy {
        Policy { mode: Mode::None, allow: Vec::new(), rules: Vec::new(), limits: Limits::default() }
    }

    pub fn parse(mode: &str, allow: &[String]) -> Result<Policy, PolicyError> {
        Self::parse_for(mode, allow, false)
    }

    /// The policy of a sandbox with the daemon's proxy (`proxied`) or without: with it, mode
    /// `none` takes allow entries too (they are what the proxy lets through).
    pub fn parse_for(mode: &str, allow: &[String], proxied: bool) -> Result<Policy, PolicyError> {
        let mode = Mode::parse(mode)?;
        if allow.len() > MAX_ALLOW {
            return Err(PolicyError::TooMany(allow.len()));
        }
        if mode == Mode::None && !allow.is_empty() && !proxied {
            return Err(PolicyError::NoneWithAllow);
        }
        let rules = allow.iter().map(|e| parse_rule(e)).collect::<Result<Vec<_>, _>>()?;
        Ok(Policy { mode, allow: allow.to_vec(), rules, limits: Limits::default() })
    }

    /// This policy with `limits` (checked).
    pub fn with_limits(self, limits: Limits) -> Result<Policy, PolicyError> {
        limits.check()?;
        Ok(Policy { limits, ..self })
    }

    /// The ports of every name entry `name` matches (none: the name is not allowed).
    pub fn name_ports(&self, name: &str) -> Vec<Ports> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.rules
            .iter()
            .filter(|r| match &r.target {
                Target::Name(n) => *n == name,
                Target::Below(s) => {
                    name.len() > s.len() + 1 && name.ends_with(s.as_str()) && {
                        name.as_bytes()[name.len() - s.len() - 1] == b'.'
                    }
                }
                Target::Net(_) => false,
            })
            .map(|r| r.ports)
            .collect()
    }

    /// Whether the daemon's DNS answers `name` for this sandbox.
    pub fn resolves(&self, name: &str) -> bool {
        match self.mode {
            Mode::None => false,
            Mode::Open => true,
            Mode::Allowlist => !self.name_ports(name).is_empty(),
        }
    }

    /// The address entries: (network, ports).
    pub fn nets(&self) -> impl Iterator<Item = (Ipv4Net, Ports)> + '_ {
        self.rules.iter().filter_map(|r| match r.target {
            Target::Net(n) => Some((n, r.ports)),
            _ => None,
        })
    }
}

fn bad(entry: &str, why: &'static str) -> PolicyError {
    PolicyError::Entry { entry: entry.to_string(), why }
}

fn parse_ports(entry: &str, s: &str) -> Result<Ports, PolicyError> {
    const WHY: &str = "the port must be a number from 1 to 65535, or a range low-high";
    let num = |p: &str| p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| bad(entry, WHY));
    let ports = match s.split_once('-') {
        Some((lo, hi)) => Ports { low: num(lo)?, high: num(hi)? },
        None => {
            let p = num(s)?;
            Ports { low: p, high: p }
        }
    };
    if ports.low > ports.high {
        return Err(bad(entry, "the port range is backwards: write low-high"));
    }
    Ok(ports)
}

fn parse_rule(entry: &str) -> Result<Rule, PolicyError> {
    let e = entry.trim();
    if e.is_empty() {
        return Err(bad(entry, "empty"));
    }
    let (host, ports) = match e.rsplit_once(':') {
        Some((h, p)) => (h, parse_ports(entry, p)?),
        None => (e, Ports::ALL),
    };
    if host.contains(':') {
        return Err(bad(entry, "IPv6 is not routed to sandboxes: give an IPv4 address, a CIDR or a name"));
    }
    if let Ok(net) = host.parse::<Ipv4Net>() {
        return Ok(Rule { target: Target::Net(net.trunc()), ports });
    }
    if let Ok(ip) = host.parse::<Ipv4Addr>() {
        return Ok(Rule { target: Target::Net(Ipv4Net::from(ip)), ports });
    }
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let (wild, name) = match host.strip_prefix("*.") {
        Some(rest) => (true, rest.to_string()),
        None => (false, host),
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(bad(
            entry,
            "not a domain name, *.domain, IPv4 address or CIDR (letters, digits, '-' and '.'; a '*.' only in front)",
        ));
    }
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad(entry, "not a valid IPv4 address or CIDR"));
    }
    Ok(Rule { target: if wild { Target::Below(name) } else { Target::Name(name) }, ports })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(mode: &str, allow: &[&str]) -> Result<Policy, PolicyError> {
        Policy::parse(mode, &allow.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn entries_parse_into_names_wildcards_and_nets() {
        let pol = p("allowlist", &["API.example.com", "*.example.org:443", "10.0.0.0/8:443", "192.168.1.7:8000-8010"])
            .unwrap();
        assert_eq!(pol.rules[0], Rule { target: Target::Name("api.example.com".into()), ports: Ports::ALL });
        assert_eq!(
            pol.rules[1],
            Rule { target: Target::Below("example.org".into()), ports: Ports { low: 443, high: 443 } }
        );
        let nets: Vec<_> = pol.nets().map(|(n, p)| (n.to_string(), p.nft())).collect();
        assert_eq!(nets, vec![("10.0.0.0/8".into(), "443".into()), ("192.168.1.7/32".into(), "8000-8010".into())]);
    }

    #[test]
    fn names_match_exactly_and_wildcards_only_below() {
        let pol = p("allowlist", &["api.example.com", "*.example.org:443"]).unwrap();
        assert!(pol.resolves("api.example.com."));
        assert!(pol.resolves("API.EXAMPLE.COM"));
        assert!(!pol.resolves("x.api.example.com"));
        assert!(!pol.resolves("example.com"));
        assert!(pol.resolves("a.example.org"));
        assert!(pol.resolves("a.b.example.org"));
        assert!(!pol.resolves("example.org"));
        assert!(!pol.resolves("badexample.org"));
        assert_eq!(pol.name_ports("a.example.org"), vec![Ports { low: 443, high: 443 }]);
        assert!(p("open", &[]).unwrap().resolves("anything.test"));
        assert!(!Policy::none().resolves("api.example.com"));
    }

    #[test]
    fn bad_input_says_what_to_change() {
        assert_eq!(p("wide", &[]).unwrap_err(), PolicyError::Mode("wide".into()));
        assert_eq!(p("none", &["a.com"]).unwrap_err(), PolicyError::NoneWithAllow);
        assert_eq!(Policy::parse_for("none", &["a.com".into()], true).unwrap().allow, vec!["a.com"]);
        let limits = |m, b| Policy::none().with_limits(Limits { max_connections: m, bandwidth_mbps: b });
        assert!(limits(Some(1), Some(0.1)).is_ok() && limits(Some(MAX_CONNECTIONS_SETTING), Some(100_000.0)).is_ok());
        for (m, b) in
            [(Some(0), None), (Some(MAX_CONNECTIONS_SETTING + 1), None), (None, Some(0.0)), (None, Some(f64::NAN))]
        {
            let e = limits(m, b).unwrap_err().to_string();
            assert!(e.contains("must be from"), "{e}");
        }
        for e in [
            "",
            "a.com:0",
            "a.com:70000",
            "a.com:9-3",
            "bad name.com",
            "*.",
            "a.*.com",
            "-a.com",
            "1.2.3.4/40",
            "::1",
            "999.1.1.1",
        ] {
            assert!(matches!(p("allowlist", &[e]), Err(PolicyError::Entry { .. })), "{e:?} accepted");
        }
        let many: Vec<String> = (0..=MAX_ALLOW).map(|i| format!("h{i}.test")).collect();
        assert_eq!(Policy::parse("allowlist", &many).unwrap_err(), PolicyError::TooMany(MAX_ALLOW + 1));
    }
}
