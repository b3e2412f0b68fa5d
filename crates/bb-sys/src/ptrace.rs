//! Running syscalls inside another process that is idle in a blocking syscall (ptrace syscall
//! injection, x86_64).
//!
//! branchbox uses it to fork a session *template* (a frozen copy of a live session, idle in
//! `recvmsg` on its channel) into another sandbox's namespaces without running any of the
//! template's own code: the daemon seizes the template, makes it `clone` a helper that shares its
//! memory, has the helper `setns` into the target sandbox and `fork` the copy there, gives the copy
//! a new channel, and then lets template and copy go on with the `recvmsg` they were in. Untrusted
//! code that ran in the session earlier cannot interfere, because none of it runs until the daemon
//! has detached; and privileged steps (the `setns`) carry arguments only the daemon knows.
//!
//! How one syscall is injected: at a ptrace stop the tracee's registers are set to
//! `rip = <a syscall instruction>`, `rax = nr`, the arguments, and `orig_rax = -1` (so the kernel
//! does not treat the stop as an interrupted syscall to restart); `PTRACE_SYSCALL` runs to the
//! syscall-entry stop and again to the exit stop, where `rax` holds the result. The syscall
//! instruction is the one the tracee's own blocking call entered through (`rip - 2` while it is
//! stopped inside a syscall). [`Tracee::resume`] puts the saved registers back with
//! `rip = that instruction` and `rax = the interrupted syscall's number`, so the tracee issues its
//! interrupted call again, exactly as the kernel's own restart would.
//!
//! Everything here must run on one thread: ptrace ties a tracee to the tracing *thread*.

use crate::{SysError, SysResult};
use std::io;

/// What [`Tracee::run_batch`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Raw results of the calls that ran, in order; a negative one (`-errno`) stopped the batch.
    /// Empty if the tracee exited (see `Tracee::batch_results`).
    pub results: Vec<i64>,
    /// Children made by fork/clone calls of the batch (traced and stopped; see [`Tracee::child`]).
    pub children: Vec<i32>,
    /// The tracee exited (the batch ended with `exit`); it is no longer traced.
    pub exited: bool,
}

/// Result of one injected syscall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Injected {
    /// The raw return value: >= 0 on success, `-errno` on failure.
    pub ret: i64,
    /// For clone/fork/vfork: pid (in our pid namespace) of the new child, which is traced too and
    /// stopped; take it over with [`Tracee::child`].
    pub child: Option<i32>,
}

impl Injected {
    /// The return value, or the error the syscall returned.
    pub fn ok(self, call: &'static str) -> SysResult<i64> {
        if self.ret < 0 && self.ret > -4096 {
            Err(SysError { call, source: io::Error::from_raw_os_error(-self.ret as i32) })
        } else {
            Ok(self.ret)
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub use imp::{PendingStop, Tracee, RUNNER_BYTES, RUNNER_DATA};

/// Whether syscall injection is implemented on this architecture.
pub const SUPPORTED: bool = cfg!(target_arch = "x86_64");

#[cfg(not(target_arch = "x86_64"))]
pub struct Tracee;

#[cfg(not(target_arch = "x86_64"))]
impl Tracee {
    pub fn seize(_pid: i32) -> SysResult<Tracee> {
        Err(SysError { call: "ptrace injection", source: io::Error::from_raw_os_error(libc::ENOSYS) })
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::*;

    const PTRACE_EVENT_STOP: i32 = 128;
    /// Kernel-internal "restart this syscall" codes seen in `rax` when a blocking syscall was
    /// interrupted by our stop (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND).
    const RESTART_CODES: [i64; 3] = [-512, -513, -514];
    /// Bytes below the stack pointer that the ABI lets leaf functions use (the red zone), plus
    /// headroom: scratch memory starts below this.
    const SCRATCH_BELOW_SP: u64 = 4096;

    /// Machine code of the batch runner: with `rbx` pointing at a table of 64-byte entries
    /// (nr, six arguments, result), make each syscall and store its result, until an entry whose
    /// nr is -1 or a negative result; then `int3`. Source:
    /// ```text
    /// loop: mov rax,[rbx]; cmp rax,-1; je done
    ///       mov rdi,[rbx+8]; mov rsi,[rbx+16]; mov rdx,[rbx+24]
    ///       mov r10,[rbx+32]; mov r8,[rbx+40]; mov r9,[rbx+48]
    ///       syscall; mov [rbx+56],rax; test rax,rax; js done
    ///       add rbx,64; jmp loop
    /// done: int3
    /// ```
    const BATCH_CODE: [u8; 51] = [
        0x48, 0x8b, 0x03, 0x48, 0x83, 0xf8, 0xff, 0x74, 0x29, 0x48, 0x8b, 0x7b, 0x08, 0x48, 0x8b, 0x73, 0x10, 0x48,
        0x8b, 0x53, 0x18, 0x4c, 0x8b, 0x53, 0x20, 0x4c, 0x8b, 0x43, 0x28, 0x4c, 0x8b, 0x4b, 0x30, 0x0f, 0x05, 0x48,
        0x89, 0x43, 0x38, 0x48, 0x85, 0xc0, 0x78, 0x06, 0x48, 0x83, 0xc3, 0x40, 0xeb, 0xce, 0xcc,
    ];
    /// Size of the runner's mapping: code, then data the caller may use, then the table.
    pub const RUNNER_BYTES: u64 = 16384;
    /// Where callers may put their own data in the runner's mapping (e.g. a msghdr).
    pub const RUNNER_DATA: u64 = 256;
    /// Where the call table starts.
    const RUNNER_TABLE: u64 = 4096;

    /// A process stopped under our ptrace, with the registers it had when we took it over.
    pub struct Tracee {
        pid: i32,
        saved: libc::user_regs_struct,
        syscall_ip: u64,
        /// False once detached or gone: Drop then does nothing.
        attached: bool,
        /// Signals that arrived while we were injecting, delivered again on resume.
        pending_signal: i32,
        /// Resume with exactly the saved registers (a process stopped anywhere, see
        /// [`PendingStop`]) rather than by re-issuing its interrupted syscall.
        exact: bool,
    }

    /// A seized process asked to stop (e.g. while its cgroup is frozen: it stops as soon as it
    /// is thawed, before running any instruction of its own). [`PendingStop::wait`] takes it.
    pub struct PendingStop {
        pid: i32,
    }

    impl PendingStop {
        /// Seize `pid` and ask it to stop, without waiting.
        pub fn request(pid: i32) -> SysResult<PendingStop> {
            let opts = libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_EXITKILL;
            ptrace(libc::PTRACE_SEIZE, pid, 0, opts as u64)?;
            if let Err(e) = ptrace(libc::PTRACE_INTERRUPT, pid, 0, 0) {
                let _ = ptrace(libc::PTRACE_DETACH, pid, 0, 0);
                return Err(e);
            }
            Ok(PendingStop { pid })
        }

        pub fn pid(&self) -> i32 {
            self.pid
        }

        /// Wait for the stop. Syscalls can then be injected through the instruction the
        /// process entered its current syscall with, or else one of its vDSO's; `resume` puts
        /// every register back as it was.
        pub fn wait(self) -> SysResult<Tracee> {
            let pid = self.pid;
            // The stop is taken here: no detach on drop.
            std::mem::forget(self);
            Self::take(pid, wait_stop(pid))
        }

        /// [`PendingStop::wait`] without blocking: `Err(self)` while the process has neither
        /// stopped nor died yet. A process can take long to stop: it stops on its way back from
        /// the syscall it sleeps in, and some sleeps are not broken by our request (a `vfork`
        /// parent waits until its child has called `exec`, and that child may be waiting for
        /// us too), so several pending stops are polled together rather than waited in turn.
        pub fn try_wait(self) -> Result<SysResult<Tracee>, PendingStop> {
            let mut status = 0;
            // SAFETY: waitpid on our tracee with a valid status pointer.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL | libc::WNOHANG) };
            if r == 0 || (r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)) {
                return Err(self);
            }
            let pid = self.pid;
            std::mem::forget(self);
            Ok(Self::take(pid, if r < 0 { Err(err("waitpid(tracee)")) } else { stop_status(status) }))
        }

        /// The tracee of a stop whose wait status is `status`.
        fn take(pid: i32, status: SysResult<i32>) -> SysResult<Tracee> {
            let status = status?;
            let saved = get_regs(pid).inspect_err(|_| {
                let _ = ptrace(libc::PTRACE_DETACH, pid, 0, 0);
            })?;
            let mut t = Tracee { pid, saved, syscall_ip: 0, attached: true, pending_signal: 0, exact: true };
            t.note_stop(status);
            let ip = t.saved.rip.wrapping_sub(2);
            t.syscall_ip = if (t.saved.orig_rax as i64) >= 0 && t.peek_u16(ip).ok() == Some(0x050f) {
                ip
            } else {
                t.vdso_syscall()?
            };
            Ok(t)
        }
    }

    /// A stop never taken: wait for it and let the process go on untouched. Blocks until the
    /// process stops, so drop only after its cgroup is thawed.
    impl Drop for PendingStop {
        fn drop(&mut self) {
            let mut status = 0;
            // SAFETY: waitpid writes only `status`, a valid local.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) };
            if r == self.pid && libc::WIFSTOPPED(status) {
                // A signal-delivery stop (not our interrupt) hands the signal back.
                let sig = if status >> 16 == PTRACE_EVENT_STOP { 0 } else { libc::WSTOPSIG(status) };
                let _ = ptrace(libc::PTRACE_DETACH, self.pid, 0, sig as u64);
            }
        }
    }

    fn err(call: &'static str) -> SysError {
        SysError::last(call)
    }

    fn ptrace(req: libc::c_uint, pid: i32, addr: u64, data: u64) -> SysResult<libc::c_long> {
        // SAFETY: every request used here takes integers or a pointer to a regs struct that the
        // caller passes as `data` and that lives for the call.
        let r = unsafe { libc::ptrace(req, pid, addr as *mut libc::c_void, data as *mut libc::c_void) };
        if r < 0 && io::Error::last_os_error().raw_os_error().unwrap_or(0) != 0 {
            return Err(err("ptrace"));
        }
        Ok(r)
    }

    fn get_regs(pid: i32) -> SysResult<libc::user_regs_struct> {
        // SAFETY: user_regs_struct is plain old data; an all-zero value is valid.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        ptrace(libc::PTRACE_GETREGS, pid, 0, &mut regs as *mut _ as u64)?;
        Ok(regs)
    }

    fn set_regs(pid: i32, regs: &libc::user_regs_struct) -> SysResult<()> {
        ptrace(libc::PTRACE_SETREGS, pid, 0, regs as *const _ as u64).map(drop)
    }

    /// Wait for `pid` to stop; Err(ESRCH) if it died instead.
    fn wait_stop(pid: i32) -> SysResult<i32> {
        loop {
            let mut status = 0;
            // SAFETY: waitpid on a specific traced pid with a valid status pointer.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::__WALL) };
            if r < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(err("waitpid(tracee)"));
            }
            return stop_status(status);
        }
    }

    /// A wait status: the stop, or Err(ESRCH) if the process died instead.
    fn stop_status(status: i32) -> SysResult<i32> {
        if libc::WIFSTOPPED(status) {
            Ok(status)
        } else {
            Err(SysError { call: "tracee", source: io::Error::from_raw_os_error(libc::ESRCH) })
        }
    }

    fn is_syscall_stop(status: i32) -> bool {
        (status >> 8) & 0xffff == (libc::SIGTRAP | 0x80)
    }

    fn event(status: i32) -> i32 {
        status >> 16
    }

    impl Tracee {
        /// Seize `pid` and stop it. It must be blocked in a syscall (an idle template): otherwise
        /// it is released at once and `EBUSY` returned.
        pub fn seize(pid: i32) -> SysResult<Tracee> {
            let opts = libc::PTRACE_O_TRACESYSGOOD
                | libc::PTRACE_O_TRACECLONE
                | libc::PTRACE_O_TRACEFORK
                | libc::PTRACE_O_TRACEVFORK
                | libc::PTRACE_O_EXITKILL;
            ptrace(libc::PTRACE_SEIZE, pid, 0, opts as u64)?;
            let mut t = Tracee {
                pid,
                saved: unsafe_zeroed_regs(),
                syscall_ip: 0,
                attached: true,
                pending_signal: 0,
                exact: false,
            };
            ptrace(libc::PTRACE_INTERRUPT, pid, 0, 0)?;
            t.wait_quiet()?;
            let regs = get_regs(pid)?;
            let in_syscall = regs.orig_rax as i64 >= 0 && RESTART_CODES.contains(&(regs.rax as i64));
            let ip = regs.rip.wrapping_sub(2);
            if !in_syscall || t.peek_u16(ip)? != 0x050f {
                // Not idle in a restartable syscall: leave it exactly as it was.
                t.attached = false;
                let _ = ptrace(libc::PTRACE_DETACH, pid, 0, 0);
                return Err(SysError { call: "seize template", source: io::Error::from_raw_os_error(libc::EBUSY) });
            }
            t.saved = regs;
            t.syscall_ip = ip;
            Ok(t)
        }

        pub fn pid(&self) -> i32 {
            self.pid
        }

        /// A child made by an injected clone/fork (traced automatically): wait for its first
        /// stop. It resumes, like us, into the interrupted syscall.
        pub fn child(&self, pid: i32) -> SysResult<Tracee> {
            let mut t = Tracee {
                pid,
                saved: self.saved,
                syscall_ip: self.syscall_ip,
                attached: true,
                pending_signal: 0,
                exact: self.exact,
            };
            t.wait_quiet()?;
            Ok(t)
        }

        /// Wait for a stop, swallowing signal-delivery stops (remembered for resume).
        fn wait_quiet(&mut self) -> SysResult<i32> {
            let status = wait_stop(self.pid).inspect_err(|_| self.attached = false)?;
            self.note_stop(status);
            Ok(status)
        }

        /// A signal-delivery stop: keep the signal for resume (the tracee stays stopped).
        fn note_stop(&mut self, status: i32) {
            let sig = libc::WSTOPSIG(status);
            if event(status) == 0 && !is_syscall_stop(status) && sig != libc::SIGTRAP && sig != libc::SIGSTOP {
                self.pending_signal = sig;
            }
        }

        /// Continue to the next syscall stop, collecting fork events and parking signals.
        fn advance_to_syscall_stop(&mut self, child: &mut Option<i32>) -> SysResult<()> {
            loop {
                ptrace(libc::PTRACE_SYSCALL, self.pid, 0, 0)?;
                let status = wait_stop(self.pid).inspect_err(|_| self.attached = false)?;
                if is_syscall_stop(status) {
                    return Ok(());
                }
                match event(status) {
                    libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK | libc::PTRACE_EVENT_CLONE => {
                        let mut msg: libc::c_ulong = 0;
                        ptrace(libc::PTRACE_GETEVENTMSG, self.pid, 0, &mut msg as *mut _ as u64)?;
                        *child = Some(msg as i32);
                    }
                    PTRACE_EVENT_STOP | 0 => {
                        let sig = libc::WSTOPSIG(status);
                        if event(status) == 0 && sig != libc::SIGTRAP {
                            self.pending_signal = sig;
                        }
                    }
                    _ => {}
                }
            }
        }

        /// Run syscall `nr` with `args` in the tracee.
        pub fn syscall(&mut self, nr: i64, args: [u64; 6]) -> SysResult<Injected> {
            let mut regs = get_regs(self.pid)?;
            regs.rip = self.syscall_ip;
            regs.rax = nr as u64;
            regs.orig_rax = u64::MAX;
            regs.rdi = args[0];
            regs.rsi = args[1];
            regs.rdx = args[2];
            regs.r10 = args[3];
            regs.r8 = args[4];
            regs.r9 = args[5];
            set_regs(self.pid, &regs)?;
            let mut child = None;
            self.advance_to_syscall_stop(&mut child)?; // entry
            self.advance_to_syscall_stop(&mut child)?; // exit
            let regs = get_regs(self.pid)?;
            Ok(Injected { ret: regs.rax as i64, child })
        }

        /// Address of `len` bytes of scratch memory in the tracee (below its saved stack
        /// pointer, under the red zone), 16-byte aligned.
        pub fn scratch(&self, len: usize) -> u64 {
            (self.saved.rsp - SCRATCH_BELOW_SP - len as u64) & !15
        }

        pub fn write_mem(&self, addr: u64, data: &[u8]) -> SysResult<()> {
            let local = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
            let remote = libc::iovec { iov_base: addr as *mut _, iov_len: data.len() };
            // SAFETY: both iovecs describe valid buffers for the length given; the remote one is
            // checked by the kernel.
            let n = unsafe { libc::process_vm_writev(self.pid, &local, 1, &remote, 1, 0) };
            if n != data.len() as isize {
                return Err(err("process_vm_writev"));
            }
            Ok(())
        }

        pub fn read_mem(&self, addr: u64, buf: &mut [u8]) -> SysResult<()> {
            let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut _, iov_len: buf.len() };
            let remote = libc::iovec { iov_base: addr as *mut _, iov_len: buf.len() };
            // SAFETY: as in write_mem.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            if n != buf.len() as isize {
                return Err(err("process_vm_readv"));
            }
            Ok(())
        }

        /// Receive up to `max` fds sent with SCM_RIGHTS on socket `sock` (an fd of the tracee):
        /// an injected `recvmsg` into scratch memory. Returns their numbers in the tracee
        /// (close-on-exec).
        pub fn recv_fds(&mut self, sock: i32, max: usize) -> SysResult<Vec<i32>> {
            const CMSG_HDR: usize = 16; // struct cmsghdr on 64-bit: len (8), level (4), type (4)
            let cmsg_space = CMSG_HDR + (max * 4).div_ceil(8) * 8;
            // Layout: msghdr (56) | iovec (16) | 8 data bytes | control buffer.
            let base = self.scratch(96 + cmsg_space);
            let (iov, data, control) = (base + 56, base + 72, base + 80);
            let mut msg = [0u8; 56];
            msg[16..24].copy_from_slice(&iov.to_ne_bytes()); // msg_iov
            msg[24..32].copy_from_slice(&1u64.to_ne_bytes()); // msg_iovlen
            msg[32..40].copy_from_slice(&control.to_ne_bytes()); // msg_control
            msg[40..48].copy_from_slice(&(cmsg_space as u64).to_ne_bytes()); // msg_controllen
            let mut vec = [0u8; 16];
            vec[..8].copy_from_slice(&data.to_ne_bytes());
            vec[8..].copy_from_slice(&8u64.to_ne_bytes());
            self.write_mem(base, &msg)?;
            self.write_mem(iov, &vec)?;
            self.write_mem(control, &vec![0u8; cmsg_space])?;
            self.syscall(libc::SYS_recvmsg, [sock as u64, base, libc::MSG_CMSG_CLOEXEC as u64, 0, 0, 0])?
                .ok("recvmsg")?;
            let mut ctl = vec![0u8; cmsg_space];
            self.read_mem(control, &mut ctl)?;
            let len = u64::from_ne_bytes(ctl[..8].try_into().expect("8 bytes")) as usize;
            let (level, kind) = (
                i32::from_ne_bytes(ctl[8..12].try_into().expect("4")),
                i32::from_ne_bytes(ctl[12..16].try_into().expect("4")),
            );
            if len < CMSG_HDR || len > cmsg_space || level != libc::SOL_SOCKET || kind != libc::SCM_RIGHTS {
                return Err(SysError {
                    call: "recvmsg (no fds arrived)",
                    source: io::Error::from_raw_os_error(libc::EPROTO),
                });
            }
            Ok(ctl[CMSG_HDR..len].chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().expect("4"))).collect())
        }

        /// Map the batch runner ([`Tracee::run_batch`]) into the tracee: one injected `mmap` of
        /// [`RUNNER_BYTES`] read-write-execute anonymous memory, with the code written at its
        /// start. Returns its address; unmap it with an injected `munmap` when done (processes
        /// forked meanwhile inherit it).
        pub fn install_runner(&mut self) -> SysResult<u64> {
            let prot = (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64;
            let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
            let addr = self.syscall(libc::SYS_mmap, [0, RUNNER_BYTES, prot, flags, u64::MAX, 0])?.ok("mmap")? as u64;
            self.write_mem(addr, &BATCH_CODE)?;
            Ok(addr)
        }

        /// Run `calls` natively in the tracee with the runner mapped at `runner`: one continue,
        /// instead of two ptrace stops per syscall. Stops after the first negative result. If the
        /// batch forks, the children are reported (traced, stopped at their first instruction,
        /// which is the runner's: give them registers before resuming them). If it ends in
        /// `exit`, [`Batch::exited`] is set and this tracee is gone.
        pub fn run_batch(&mut self, runner: u64, calls: &[(i64, [u64; 6])]) -> SysResult<Batch> {
            let table = runner + RUNNER_TABLE;
            if (calls.len() as u64 + 1) * 64 > RUNNER_BYTES - RUNNER_TABLE {
                return Err(SysError { call: "run_batch", source: io::Error::from_raw_os_error(libc::E2BIG) });
            }
            let mut bytes = Vec::with_capacity((calls.len() + 1) * 64);
            for (nr, args) in calls {
                bytes.extend_from_slice(&nr.to_ne_bytes());
                for a in args {
                    bytes.extend_from_slice(&a.to_ne_bytes());
                }
                bytes.extend_from_slice(&i64::MIN.to_ne_bytes()); // "did not run"
            }
            bytes.extend_from_slice(&(-1i64).to_ne_bytes());
            bytes.resize((calls.len() + 1) * 64, 0);
            self.write_mem(table, &bytes)?;
            let mut regs = get_regs(self.pid)?;
            regs.rip = runner;
            regs.rbx = table;
            regs.orig_rax = u64::MAX;
            set_regs(self.pid, &regs)?;
            let mut out = Batch::default();
            let mut sig = 0u64;
            loop {
                ptrace(libc::PTRACE_CONT, self.pid, 0, sig)?;
                sig = 0;
                let mut status = 0;
                // SAFETY: waitpid on our tracee with a valid status pointer.
                let r = unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) };
                if r < 0 {
                    if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                        continue;
                    }
                    return Err(err("waitpid(tracee)"));
                }
                if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                    self.attached = false;
                    out.exited = true;
                    break;
                }
                match event(status) {
                    libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK | libc::PTRACE_EVENT_CLONE => {
                        let mut msg: libc::c_ulong = 0;
                        ptrace(libc::PTRACE_GETEVENTMSG, self.pid, 0, &mut msg as *mut _ as u64)?;
                        out.children.push(msg as i32);
                    }
                    0 if libc::WSTOPSIG(status) == libc::SIGTRAP => break, // the runner's int3
                    0 => sig = libc::WSTOPSIG(status) as u64,              // deliver other signals
                    _ => {}
                }
            }
            if !out.exited {
                out.results = self.batch_results(runner, calls.len())?;
            }
            Ok(out)
        }

        /// Results of the last batch run with the runner at `runner` (`count` calls), read through
        /// this tracee: after a batch that ended in `exit`, read them through a process that
        /// shares the runner's memory (the one the exited helper was cloned from).
        pub fn batch_results(&self, runner: u64, count: usize) -> SysResult<Vec<i64>> {
            let mut table = vec![0u8; count * 64];
            self.read_mem(runner + RUNNER_TABLE, &mut table)?;
            Ok(table
                .chunks_exact(64)
                .map(|e| i64::from_ne_bytes(e[56..64].try_into().expect("8 bytes")))
                .take_while(|r| *r != i64::MIN)
                .collect())
        }

        fn peek_u16(&self, addr: u64) -> SysResult<u16> {
            // PEEKTEXT also works on execute-only pages, which process_vm_readv may not read.
            // SAFETY: clearing errno before PEEKTEXT, whose -1 result is ambiguous.
            unsafe { *libc::__errno_location() = 0 };
            let word = ptrace(libc::PTRACE_PEEKTEXT, self.pid, addr, 0)?;
            Ok(word as u16)
        }

        /// Address of a `syscall` instruction in the tracee's vDSO.
        fn vdso_syscall(&self) -> SysResult<u64> {
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.pid))
                .map_err(|source| SysError { call: "read maps", source })?;
            let range = maps
                .lines()
                .find(|l| l.ends_with("[vdso]"))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|r| r.split_once('-'))
                .and_then(|(a, b)| Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?)));
            let no =
                || SysError { call: "find a syscall instruction", source: io::Error::from_raw_os_error(libc::ENOEXEC) };
            let (a, b) = range.ok_or_else(no)?;
            let mut code = vec![0u8; (b - a) as usize];
            self.read_mem(a, &mut code)?;
            code.windows(2).position(|w| w == [0x0f, 0x05]).map(|i| a + i as u64).ok_or_else(no)
        }

        /// Put the saved registers back and detach: the interrupted syscall is issued again
        /// (or, for a process taken with [`PendingStop`], everything is exactly as it was).
        pub fn resume(mut self) -> SysResult<()> {
            let mut regs = self.saved;
            if !self.exact {
                regs.rip = self.syscall_ip;
                regs.rax = self.saved.orig_rax;
                regs.orig_rax = u64::MAX;
            }
            set_regs(self.pid, &regs)?;
            self.attached = false;
            ptrace(libc::PTRACE_DETACH, self.pid, 0, self.pending_signal as u64).map(drop)
        }

        /// Make the tracee call `exit(code)` (it ends; its parent reaps it).
        pub fn exit(mut self, code: i32) -> SysResult<()> {
            let mut regs = get_regs(self.pid)?;
            regs.rip = self.syscall_ip;
            regs.rax = libc::SYS_exit as u64;
            regs.orig_rax = u64::MAX;
            regs.rdi = code as u64;
            set_regs(self.pid, &regs)?;
            self.attached = false;
            ptrace(libc::PTRACE_CONT, self.pid, 0, 0)?;
            // Collect the exit notification meant for us as tracer.
            let mut status = 0;
            // SAFETY: waitpid on the traced pid.
            unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) };
            Ok(())
        }

        /// SIGKILL the tracee (for copies that failed half-way).
        pub fn kill(mut self) {
            self.attached = false;
            // Best effort: a tracee cannot have been reaped by anyone while we trace it.
            let _ = crate::process::kill(self.pid, libc::SIGKILL);
            // SAFETY: waitpid(2) on our own tracee, no status wanted.
            unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), libc::__WALL) };
        }
    }

    impl Drop for Tracee {
        /// A tracee dropped without `resume`/`exit`/`kill` (an error path) goes back to what it
        /// was doing.
        fn drop(&mut self) {
            if self.attached {
                let mut regs = self.saved;
                if !self.exact {
                    regs.rip = self.syscall_ip;
                    regs.rax = self.saved.orig_rax;
                    regs.orig_rax = u64::MAX;
                }
                let _ = set_regs(self.pid, &regs);
                let _ = ptrace(libc::PTRACE_DETACH, self.pid, 0, self.pending_signal as u64);
            }
        }
    }

    fn unsafe_zeroed_regs() -> libc::user_regs_struct {
        // SAFETY: user_regs_struct is plain old data; all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;

        /// A child blocked in read() on a socket, like an idle template. It answers each read
        /// with the bytes followed by " from <its pid>". No allocation after fork (the test
        /// harness is multi-threaded).
        fn idle_child() -> (i32, UnixStream, i32) {
            let (ours, theirs) = UnixStream::pair().unwrap();
            let fd = std::os::fd::AsRawFd::as_raw_fd(&theirs);
            let ours_fd = std::os::fd::AsRawFd::as_raw_fd(&ours);
            // SAFETY: the child only makes raw syscalls on stack buffers and then _exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: closing our copy of the test's end.
                unsafe { libc::close(ours_fd) };
                let mut buf = [0u8; 96];
                loop {
                    // SAFETY: raw syscalls on a stack buffer and an fd we hold.
                    unsafe {
                        let n = libc::read(fd, buf.as_mut_ptr().cast(), 32);
                        if n <= 0 {
                            libc::_exit(0);
                        }
                        let mut len = n as usize;
                        for b in b" from " {
                            buf[len] = *b;
                            len += 1;
                        }
                        let mut digits = [0u8; 12];
                        let (mut p, mut k) = (libc::getpid() as u32, 0);
                        loop {
                            digits[k] = b'0' + (p % 10) as u8;
                            k += 1;
                            p /= 10;
                            if p == 0 {
                                break;
                            }
                        }
                        while k > 0 {
                            k -= 1;
                            buf[len] = digits[k];
                            len += 1;
                        }
                        libc::write(fd, buf.as_ptr().cast(), len);
                    }
                }
            }
            drop(theirs);
            (pid, ours, fd)
        }

        #[test]
        fn inject_getpid_fork_and_resume() {
            let (pid, mut chan, old) = idle_child();
            std::thread::sleep(std::time::Duration::from_millis(50));
            let mut t = Tracee::seize(pid).expect("seize idle child");
            assert_eq!(t.syscall(libc::SYS_getpid, [0; 6]).unwrap().ret, pid as i64);
            // A bad syscall reports -errno and leaves the tracee usable.
            let bad = t.syscall(libc::SYS_close, [9999, 0, 0, 0, 0, 0]).unwrap();
            assert_eq!(bad.ok("close").unwrap_err().errno(), libc::EBADF);
            // Memory round trip through scratch space.
            let at = t.scratch(16);
            t.write_mem(at, b"0123456789abcdef").unwrap();
            let mut back = [0u8; 16];
            t.read_mem(at, &mut back).unwrap();
            assert_eq!(&back, b"0123456789abcdef");
            // fork: the copy is traced and stopped; give it its own channel, then let both go.
            let forked = t.syscall(libc::SYS_fork, [0; 6]).unwrap();
            let cpid = forked.child.expect("fork reports the child");
            assert_eq!(forked.ret, cpid as i64);
            let mut c = t.child(cpid).unwrap();
            let sv = c.scratch(8);
            let r = c
                .syscall(
                    libc::SYS_socketpair,
                    [libc::AF_UNIX as u64, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64, 0, sv, 0, 0],
                )
                .unwrap();
            assert_eq!(r.ret, 0);
            let mut fds = [0u8; 8];
            c.read_mem(sv, &mut fds).unwrap();
            let (a, b) =
                (i32::from_ne_bytes(fds[..4].try_into().unwrap()), i32::from_ne_bytes(fds[4..].try_into().unwrap()));
            // The copy reads fd `old` (its copy of the channel): put its new channel there.
            assert_eq!(c.syscall(libc::SYS_dup3, [a as u64, old as u64, 0, 0, 0, 0]).unwrap().ret, old as i64);
            let pidfd = crate::process::pidfd_open(cpid).unwrap();
            // SAFETY: pidfd_getfd with a valid pidfd; the result is a new fd we own.
            let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, std::os::fd::AsRawFd::as_raw_fd(&pidfd), b, 0) };
            assert!(mine >= 0, "pidfd_getfd: {}", io::Error::last_os_error());
            // SAFETY: mine is a fresh fd owned by nobody else.
            let mut copy_chan: UnixStream = unsafe { std::os::fd::FromRawFd::from_raw_fd(mine as i32) };
            // fds sent on our end arrive in the copy through an injected recvmsg.
            let (p_r, p_w) = nix::unistd::pipe().unwrap();
            let theirs_end = crate::process::pidfd_getfd(&pidfd, b).unwrap();
            nix::sys::socket::sendmsg::<()>(
                std::os::fd::AsRawFd::as_raw_fd(&theirs_end),
                &[std::io::IoSlice::new(b"x")],
                &[nix::sys::socket::ControlMessage::ScmRights(&[
                    std::os::fd::AsRawFd::as_raw_fd(&p_r),
                    std::os::fd::AsRawFd::as_raw_fd(&p_w),
                ])],
                nix::sys::socket::MsgFlags::empty(),
                None,
            )
            .unwrap();
            let got = c.recv_fds(a, 4).unwrap();
            assert_eq!(got.len(), 2, "two fds arrive");
            let pipe_w = got[1];
            let msg = c.scratch(8);
            c.write_mem(msg, b"hey!").unwrap();
            assert_eq!(c.syscall(libc::SYS_write, [pipe_w as u64, msg, 4, 0, 0, 0]).unwrap().ret, 4);
            let mut four = [0u8; 4];
            nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&p_r), &mut four).unwrap();
            assert_eq!(&four, b"hey!", "the copy wrote into the pipe it received");
            for fd in got {
                c.syscall(libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0]).unwrap();
            }
            drop((p_r, p_w, theirs_end));
            c.syscall(libc::SYS_close, [a as u64, 0, 0, 0, 0, 0]).unwrap();
            c.syscall(libc::SYS_close, [b as u64, 0, 0, 0, 0, 0]).unwrap();
            c.resume().unwrap();
            t.resume().unwrap();
            // Both go on with their read(): each answers on its own channel.
            chan.write_all(b"hi").unwrap();
            copy_chan.write_all(b"yo").unwrap();
            let mut buf = [0u8; 64];
            let n = chan.read(&mut buf).unwrap();
            assert_eq!(std::str::from_utf8(&buf[..n]).unwrap(), format!("hi from {pid}"));
            let n = copy_chan.read(&mut buf).unwrap();
            assert!(std::str::from_utf8(&buf[..n]).unwrap().starts_with("yo from "), "copy answers on its channel");
            drop(chan);
            drop(copy_chan);
            // SAFETY: reaping our children.
            unsafe {
                libc::waitpid(pid, std::ptr::null_mut(), 0);
                libc::waitpid(cpid, std::ptr::null_mut(), 0);
            }
        }

        #[test]
        fn a_batch_runs_natively_forks_and_stops_at_the_first_error() {
            let (pid, chan, _) = idle_child();
            std::thread::sleep(std::time::Duration::from_millis(50));
            let mut t = Tracee::seize(pid).unwrap();
            let runner = t.install_runner().unwrap();
            let b = t.run_batch(runner, &[(libc::SYS_getpid, [0; 6]), (libc::SYS_getppid, [0; 6])]).unwrap();
            // SAFETY: getpid has no failure mode.
            assert_eq!(b.results, vec![pid as i64, unsafe { libc::getpid() } as i64]);
            assert!(b.children.is_empty() && !b.exited);
            // An error stops the batch: the third call does not run.
            let b = t
                .run_batch(
                    runner,
                    &[(libc::SYS_getpid, [0; 6]), (libc::SYS_close, [9999, 0, 0, 0, 0, 0]), (libc::SYS_getpid, [0; 6])],
                )
                .unwrap();
            assert_eq!(b.results, vec![pid as i64, -(libc::EBADF as i64)]);
            // A clone sharing memory, then a batch in the clone that forks and exits.
            let c = t.syscall(libc::SYS_clone, [(libc::CLONE_VM | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0]).unwrap();
            let mut helper = t.child(c.child.unwrap()).unwrap();
            let b = helper.run_batch(runner, &[(libc::SYS_fork, [0; 6]), (libc::SYS_exit, [0; 6])]).unwrap();
            assert!(b.exited, "the helper exited at the end of its batch");
            assert_eq!(b.children.len(), 1);
            let results = t.batch_results(runner, 2).unwrap();
            assert_eq!(results, vec![b.children[0] as i64], "fork's result is the child; exit never returns");
            let copy = t.child(b.children[0]).unwrap();
            let copy_pid = copy.pid();
            copy.resume().unwrap();
            t.syscall(libc::SYS_munmap, [runner, RUNNER_BYTES, 0, 0, 0, 0]).unwrap().ok("munmap").unwrap();
            t.resume().unwrap();
            drop(chan);
            // SAFETY: reaping our child, no status wanted.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
            // The helper was the original child's child.
            let _ = crate::process::kill(copy_pid, libc::SIGKILL);
        }

        #[test]
        fn a_running_process_is_stopped_anywhere_and_resumed_exactly() {
            // A child spinning in user code (no syscall to borrow): the vDSO's is used.
            let (p_r, p_w) = nix::unistd::pipe().unwrap();
            let wfd = std::os::fd::AsRawFd::as_raw_fd(&p_w);
            // SAFETY: the child spins and writes a byte when told, without allocating.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                    if x & ((1 << 26) - 1) == 0 {
                        // SAFETY: write(2) of one stack byte to our pipe.
                        unsafe { libc::write(wfd, b"x".as_ptr().cast(), 1) };
                    }
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            let mut t = PendingStop::request(pid).unwrap().wait().unwrap();
            // Inject getpid and chdir("/tmp") (string in scratch memory below its stack).
            assert_eq!(t.syscall(libc::SYS_getpid, [0; 6]).unwrap().ret, pid as i64);
            let at = t.scratch(16);
            t.write_mem(at, b"/tmp\0").unwrap();
            assert_eq!(t.syscall(libc::SYS_chdir, [at, 0, 0, 0, 0, 0]).unwrap().ret, 0);
            t.resume().unwrap();
            assert_eq!(std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(), std::path::Path::new("/tmp"));
            // It goes on computing where it was: it still writes bytes.
            let mut b = [0u8; 1];
            assert_eq!(nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&p_r), &mut b).unwrap(), 1);
            crate::process::kill(pid, libc::SIGKILL).unwrap();
            // SAFETY: reaping our child, no status wanted.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }

        #[test]
        fn a_busy_process_is_refused_and_left_alone() {
            // SAFETY: the child spins without touching shared state.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            let e = Tracee::seize(pid).err().expect("a running process is not idle in a syscall");
            assert_eq!(e.errno(), libc::EBUSY);
            // It still runs (not stopped, not traced).
            std::thread::sleep(std::time::Duration::from_millis(20));
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat.rsplit(')').next().unwrap().split_whitespace().next().unwrap();
            assert_eq!(state, "R", "state {state}");
            crate::process::kill(pid, libc::SIGKILL).unwrap();
            // SAFETY: reaping our child, no status wanted.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }
    }
}
