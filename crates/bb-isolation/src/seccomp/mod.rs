//! Seccomp: compile a policy written in seccompiler's JSON format into one classic-BPF program
//! for the running architecture, and install it.
//!
//! A policy is a map of named filters, each with one `match_action` for all its rules (that is
//! seccompiler's format). The filters are evaluated in name order and **linked into a single
//! program**: wherever a filter would return "allow", control jumps to the next filter instead,
//! so the first filter that returns anything else decides. A policy therefore costs one
//! `seccomp(2)` call and one program per syscall, however many filters it has.
//!
//! The program starts with an architecture check (anything but the native ABI, e.g. i386
//! `int 0x80` on x86_64 or arm32 compat on aarch64, kills the process, as seccompiler does) and,
//! on x86_64, a rule returning ENOSYS for the x32 ABI (syscall numbers with bit 30 set), which
//! shares the x86_64 audit arch and would otherwise bypass every number-based rule.

mod syscalls;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule, TargetArch,
};
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::{IsolationError, Result};

/// The default sandbox policy (`crates/bb-isolation/seccomp/default.json`).
pub const DEFAULT_POLICY_JSON: &str = include_str!("../../seccomp/default.json");

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_DATA_NR: u32 = 0;
const SECCOMP_DATA_ARCH: u32 = 4;
pub(crate) const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
pub(crate) const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
pub(crate) const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
pub(crate) const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
pub(crate) const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// The kernel's limit on the length of one seccomp program (BPF_MAXINSNS).
const BPF_MAXINSNS: usize = 4096;

/// A compiled seccomp program. Compile once (in the daemon), apply many times (in each child).
///
/// The policy's filters (seccompiler allows one `match_action` per filter, so the default policy
/// has an EPERM filter and a clone3/ENOSYS filter) are evaluated in name order and linked into
/// one program: an "allow" of one filter continues with the next, the first other verdict wins.
/// In front sits an architecture check (foreign ABIs are killed) and, on x86_64, ENOSYS for x32
/// syscall numbers.
#[derive(Clone)]
pub struct SeccompFilter {
    program: BpfProgram,
}

impl fmt::Debug for SeccompFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeccompFilter").field("instructions", &self.program.len()).finish()
    }
}

impl SeccompFilter {
    /// The default policy ([`DEFAULT_POLICY_JSON`]) compiled for the running architecture.
    pub fn default_policy() -> Result<SeccompFilter> {
        SeccompFilter::from_json(DEFAULT_POLICY_JSON)
    }

    /// Compile a policy in seccompiler's JSON format for the running architecture.
    pub fn from_json(json: &str) -> Result<SeccompFilter> {
        Ok(SeccompFilter { program: compile(json, native_arch()?)? })
    }

    /// The default policy, except that `setns` passes when its (otherwise unused) third and
    /// fourth arguments equal `key` (see [`SetnsKey`]).
    pub fn default_policy_with_setns_key(key: SetnsKey) -> Result<SeccompFilter> {
        Ok(SeccompFilter { program: compile_keyed(DEFAULT_POLICY_JSON, native_arch()?, Some(key))? })
    }

    /// Install the filter on the calling thread (only; apply it in the single-threaded child
    /// right before `execve`, it is inherited across fork/clone/execve). Also sets
    /// `no_new_privs`, which seccomp requires of callers without CAP_SYS_ADMIN. Does not
    /// allocate, also not on error, so it is safe between `fork`/`clone3` and `execve` of a
    /// multi-threaded parent. Irreversible.
    pub fn apply(&self) -> Result<()> {
        seccompiler::apply_filter(&self.program).map_err(IsolationError::SeccompApply)
    }

    /// [`apply`](Self::apply) without `no_new_privs`, so that setuid programs (`sudo`) still
    /// take effect after it: the filter stays on them. The kernel allows that only to a caller
    /// with CAP_SYS_ADMIN in its user namespace (EACCES otherwise): apply it before dropping
    /// capabilities. Does not allocate, also not on error. Irreversible.
    pub fn apply_keeping_setuid(&self) -> Result<()> {
        let prog = libc::sock_fprog {
            len: self.program.len() as u16,
            // seccompiler's sock_filter is the kernel's struct (repr(C), same fields as libc's).
            filter: self.program.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: the kernel copies the program in (copy_from_user) and keeps no pointer to it;
        // `prog` and the program it points to outlive the call.
        let rc = unsafe {
            libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog as *const libc::sock_fprog)
        };
        if rc != 0 {
            return Err(IsolationError::SeccompApply(seccompiler::Error::Seccomp(std::io::Error::last_os_error())));
        }
        Ok(())
    }

    /// Length of the BPF program in instructions.
    pub fn instruction_count(&self) -> usize {
        self.program.len()
    }

    #[cfg(test)]
    pub(crate) fn program(&self) -> &[sock_filter] {
        &self.program
    }
}

pub(crate) fn native_arch() -> Result<TargetArch> {
    match std::env::consts::ARCH {
        "x86_64" => Ok(TargetArch::x86_64),
        "aarch64" => Ok(TargetArch::aarch64),
        other => Err(IsolationError::UnsupportedArch(other)),
    }
}

/// One filter of a policy: seccompiler's JSON filter object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonFilter {
    #[serde(alias = "default_action")]
    mismatch_action: SeccompAction,
    #[serde(alias = "filter_action")]
    match_action: SeccompAction,
    #[serde(rename = "filter")]
    rules: Vec<JsonRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRule {
    syscall: String,
    args: Option<Vec<JsonCondition>>,
    #[serde(rename = "comment")]
    _comment: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonCondition {
    index: u8,
    #[serde(rename = "type")]
    arg_len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    val: u64,
    #[serde(rename = "comment")]
    _comment: Option<String>,
}

/// The top-level map, sorted by filter name; duplicate names are an error (serde_json would
/// silently keep the last one).
struct Policy(BTreeMap<String, JsonFilter>);

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Policy;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from filter names to seccompiler filter objects")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> std::result::Result<Policy, M::Error> {
                let mut out = BTreeMap::new();
                while let Some((name, filter)) = m.next_entry::<String, JsonFilter>()? {
                    if out.contains_key(&name) {
                        return Err(serde::de::Error::custom(format!("duplicate filter name {name:?}")));
                    }
                    out.insert(name, filter);
                }
                Ok(Policy(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A secret that lets `setns(fd, nstype, key[0], key[1])` through a filter that otherwise
/// denies `setns`.
///
/// setns(2) takes two arguments; the kernel ignores the registers of the third and fourth, but
/// seccomp sees them. The daemon forks session templates into other sandboxes' namespaces by
/// injecting that one `setns` into a stopped helper process (see `bb_sys::ptrace`): with the key
/// in those registers it passes; any other caller, which does not know the key, gets EPERM. The
/// key lives only in the daemon, in the kernel's copy of each filter, and in sandbox inits, whose
/// memory sandbox processes cannot read (they are non-dumpable and the sandboxes lack
/// CAP_SYS_PTRACE). 128 random bits: guessing is hopeless.
pub type SetnsKey = [u64; 2];

/// Compile a JSON policy for `arch` into one linked program.
pub(crate) fn compile(json: &str, arch: TargetArch) -> Result<BpfProgram> {
    compile_keyed(json, arch, None)
}

pub(crate) fn compile_keyed(json: &str, arch: TargetArch, key: Option<SetnsKey>) -> Result<BpfProgram> {
    let programs = compile_filters_keyed(json, arch, key)?;
    link(arch, programs.into_iter().map(|(_, p)| p).collect())
}

/// Compile each filter of the policy separately (seccompiler's output, before linking).
#[cfg(test)]
pub(crate) fn compile_filters(json: &str, arch: TargetArch) -> Result<Vec<(String, BpfProgram)>> {
    compile_filters_keyed(json, arch, None)
}

/// Replace each unconditional `setns` rule of a denying filter by "setns whose third argument is
/// not key[0]" and "... fourth argument is not key[1]": the filter's verdict then applies unless
/// both match.
fn gate_setns(policy: &mut Policy, key: SetnsKey) {
    for filter in policy.0.values_mut() {
        if matches!(filter.match_action, SeccompAction::Allow) {
            continue;
        }
        let before = filter.rules.len();
        filter.rules.retain(|r| !(r.syscall == "setns" && r.args.is_none()));
        if filter.rules.len() == before {
            continue;
        }
        for (index, val) in [(2u8, key[0]), (3u8, key[1])] {
            filter.rules.push(JsonRule {
                syscall: "setns".into(),
                args: Some(vec![JsonCondition {
                    index,
                    arg_len: SeccompCmpArgLen::Qword,
                    op: SeccompCmpOp::Ne,
                    val,
                    _comment: None,
                }]),
                _comment: None,
            });
        }
    }
}

fn compile_filters_keyed(json: &str, arch: TargetArch, key: Option<SetnsKey>) -> Result<Vec<(String, BpfProgram)>> {
    let mut policy: Policy =
        serde_json::from_str(json).map_err(|e| IsolationError::SeccompPolicy(format!("invalid JSON: {e}")))?;
    if let Some(key) = key {
        gate_setns(&mut policy, key);
    }
    if policy.0.is_empty() {
        return Err(IsolationError::SeccompPolicy("the policy has no filters".to_owned()));
    }
    policy
        .0
        .into_iter()
        .map(|(name, filter)| {
            let program = compile_filter(&name, filter, arch)?;
            Ok((name, program))
        })
        .collect()
}

fn compile_filter(name: &str, filter: JsonFilter, arch: TargetArch) -> Result<BpfProgram> {
    let backend = |source| IsolationError::SeccompCompile { filter: name.to_owned(), source };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let mut unconditional: BTreeMap<i64, &str> = BTreeMap::new();
    for rule in &filter.rules {
        let Some(nr) = resolve(&rule.syscall, arch)? else {
            continue; // does not exist on this architecture: nothing to filter
        };
        let chain = rules.entry(nr).or_default();
        let mixed = match &rule.args {
            None => {
                unconditional.insert(nr, &rule.syscall);
                !chain.is_empty()
            }
            Some(args) => {
                let conditions = args
                    .iter()
                    .map(|c| SeccompCondition::new(c.index, c.arg_len.clone(), c.op.clone(), c.val))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(backend)?;
                chain.push(SeccompRule::new(conditions).map_err(backend)?);
                unconditional.contains_key(&nr)
            }
        };
        if mixed {
            // seccompiler would silently drop the unconditional entry.
            return Err(IsolationError::SeccompPolicy(format!(
                "filter {name:?}: syscall {:?} has rules both with and without \"args\"; a rule \
                 without args already matches every call, so remove the ones with args (or the \
                 one without)",
                rule.syscall
            )));
        }
    }
    let filter =
        seccompiler::SeccompFilter::new(rules, filter.mismatch_action, filter.match_action, arch).map_err(backend)?;
    BpfProgram::try_from(filter).map_err(backend)
}

/// Syscall number of `name` on `arch`; `Ok(None)` if it does not exist there.
fn resolve(name: &str, arch: TargetArch) -> Result<Option<i64>> {
    if let Some(&(_, x86_64, aarch64)) = syscalls::SYSCALLS.iter().find(|(n, _, _)| *n == name) {
        let nr = match arch {
            TargetArch::x86_64 => x86_64,
            TargetArch::aarch64 => aarch64,
        };
        return Ok(nr.map(i64::from));
    }
    seccompiler_syscall_nr(name, arch).map(Some).ok_or_else(|| {
        IsolationError::SeccompPolicy(format!(
            "unknown syscall {name:?} on {arch:?}: check the spelling; if it is newer than \
             seccompiler's table or missing on some architecture, add it to SYSCALLS in \
             crates/bb-isolation/src/seccomp/syscalls.rs"
        ))
    })
}

/// Look a name up in seccompiler's (private) syscall table by compiling a one-rule probe filter
/// and reading the number from its first syscall comparison.
pub(crate) fn seccompiler_syscall_nr(name: &str, arch: TargetArch) -> Option<i64> {
    let probe = serde_json::json!({
        "probe": {
            "mismatch_action": "allow",
            "match_action": "trap",
            "filter": [{ "syscall": name }],
        }
    });
    let map = seccompiler::compile_from_json(probe.to_string().as_bytes(), arch).ok()?;
    // [0..3) architecture check, [3] load nr, [4] compare with this syscall's number.
    let jeq = map.get("probe")?.get(4)?;
    (jeq.code == BPF_JMP_JEQ_K).then_some(i64::from(jeq.k))
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// Prelude + all filter programs, with every "allow" of a non-last program turned into a jump to
/// the start of the next program. Replacing one instruction by one keeps every other offset
/// valid, and the kernel's checker verifies that all jumps stay in bounds.
fn link(arch: TargetArch, programs: Vec<BpfProgram>) -> Result<BpfProgram> {
    let mut out = match arch {
        TargetArch::x86_64 => vec![
            stmt(BPF_LD_W_ABS, SECCOMP_DATA_ARCH),
            jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
            stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
            stmt(BPF_LD_W_ABS, SECCOMP_DATA_NR),
            jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
            stmt(BPF_RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        ],
        // aarch64 has no second ABI under the same audit arch; arm32 compat is rejected by the
        // architecture check at the start of each filter.
        TargetArch::aarch64 => Vec::new(),
    };
    let count = programs.len();
    for (i, program) in programs.into_iter().enumerate() {
        let last = i + 1 == count;
        let len = program.len();
        for (j, ins) in program.into_iter().enumerate() {
            if !last && ins.code == BPF_RET_K && ins.k == SECCOMP_RET_ALLOW {
                out.push(stmt(BPF_JMP_JA, (len - j - 1) as u32));
            } else {
                out.push(ins);
            }
        }
    }
    if out.len() > BPF_MAXINSNS {
        return Err(IsolationError::SeccompPolicy(format!(
            "the linked program has {} instructions, more than the kernel's limit of \
             {BPF_MAXINSNS}; use fewer rules",
            out.len()
        )));
    }
    Ok(out)
}
