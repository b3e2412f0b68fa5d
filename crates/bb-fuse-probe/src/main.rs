//! `branchbox-fuse-probe SOURCE MOUNTPOINT [--passthrough]`: serves directory SOURCE at
//! MOUNTPOINT through FUSE, so that design (b) of persistent volumes (a FUSE filesystem served by
//! the daemon) can be measured against design (a) (an overlayfs mount) by `branchbox bench
//! volume-designs`. A probe for that decision, not product code.
//!
//! * Caching: entries and attributes are cached for [`TTL`], opened files keep their page cache
//!   (`FOPEN_KEEP_CACHE`), directory reads carry attributes (readdirplus) and, without
//!   passthrough, writes go through the kernel's writeback cache.
//! * `--passthrough`: regular files are opened with FUSE passthrough, so the kernel reads and
//!   writes the backing file itself (the kernel does not take passthrough together with the
//!   writeback cache). When the kernel does not offer it, or registering a backing file fails,
//!   the probe says why on stdout and serves those files itself.
//! * Inodes: a FUSE inode number is the backing `st_ino` (SOURCE must be one filesystem), the
//!   root's is 1. The probe remembers the last path it saw for each and never forgets one (a
//!   deleted file's entry stays until its number is reused). Files are created as the probe's
//!   user; `default_permissions` has the kernel check access. `flush` is not implemented, so the
//!   kernel stops sending it (the writeback cache is still written back on close); renames
//!   that exchange are refused.
//!
//! stdout: one JSON line once mounted (`"event": "mounted"`, the mode used) and one once
//! unmounted (how many opens were passthrough). It serves until SIGTERM or SIGINT, then unmounts.

use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, DirEntryExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use fuser::{
    BackingId, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, Session, TimeOrNow,
    WriteFlags,
};

/// How long the kernel may cache entries and attributes.
const TTL: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(about = "Serve directory SOURCE at MOUNTPOINT through FUSE until SIGTERM (a probe for volume designs)")]
struct Args {
    source: PathBuf,
    mountpoint: PathBuf,
    /// Open regular files with FUSE passthrough (falls back, saying why, when it cannot).
    #[arg(long)]
    passthrough: bool,
    /// Threads serving requests.
    #[arg(long, default_value_t = 4)]
    threads: usize,
}

/// What was negotiated with the kernel and what the opens did (shared with `main`).
#[derive(Default)]
struct Status {
    passthrough: AtomicBool,
    writeback: AtomicBool,
    readdirplus: AtomicBool,
    why_not_passthrough: Mutex<Option<String>>,
    passthrough_opens: AtomicU64,
    cached_opens: AtomicU64,
}

impl Status {
    fn not_passthrough(&self, why: String) {
        self.why_not_passthrough.lock().unwrap().get_or_insert(why);
    }
}

/// An open file: the backing file, and with passthrough its inode's backing id.
struct Open {
    ino: u64,
    file: Arc<File>,
    backing: Option<Arc<BackingId>>,
}

struct DirEnt {
    ino: u64,
    kind: FileType,
    name: OsString,
}

struct Probe {
    root_ino: u64,
    want_passthrough: bool,
    status: Arc<Status>,
    paths: RwLock<HashMap<u64, PathBuf>>,
    files: RwLock<HashMap<u64, Open>>,
    dirs: Mutex<HashMap<u64, Arc<Vec<DirEnt>>>>,
    /// Every passthrough open of an inode must use the same backing file.
    backing: Mutex<HashMap<u64, Weak<BackingId>>>,
    next_fh: AtomicU64,
}

type Res<T> = Result<T, Errno>;

fn time(secs: i64, nsecs: i64) -> SystemTime {
    let whole = Duration::from_secs(secs.unsigned_abs());
    (if secs >= 0 { UNIX_EPOCH + whole } else { UNIX_EPOCH - whole }) + Duration::from_nanos(nsecs as u64)
}

fn attr(ino: u64, m: &fs::Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: time(m.atime(), m.atime_nsec()),
        mtime: time(m.mtime(), m.mtime_nsec()),
        ctime: time(m.ctime(), m.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind: FileType::from_std(m.file_type()).unwrap_or(FileType::RegularFile),
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        blksize: m.blksize() as u32,
        flags: 0,
    }
}

fn cstr(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn utimens(path: &Path, atime: Option<TimeOrNow>, mtime: Option<TimeOrNow>) -> io::Result<()> {
    let ts = |t: Option<TimeOrNow>| match t {
        None => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        Some(TimeOrNow::Now) => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        Some(TimeOrNow::SpecificTime(t)) => {
            let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
            libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos().into() }
        }
    };
    let (path, times) = (cstr(path)?, [ts(atime), ts(mtime)]);
    // SAFETY: `path` is NUL-terminated and `times` holds the two timespecs utimensat reads; both
    // outlive the call.
    check(unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) })
}

impl Probe {
    fn new(source: &Path, want_passthrough: bool, status: Arc<Status>) -> io::Result<Self> {
        let root = source.canonicalize()?;
        let root_ino = fs::metadata(&root)?.ino();
        Ok(Self {
            root_ino,
            want_passthrough,
            status,
            paths: RwLock::new(HashMap::from([(1, root)])),
            files: RwLock::default(),
            dirs: Mutex::default(),
            backing: Mutex::default(),
            next_fh: AtomicU64::new(1),
        })
    }

    fn ino(&self, backing_ino: u64) -> u64 {
        if backing_ino == self.root_ino {
            1
        } else {
            backing_ino
        }
    }

    fn path(&self, ino: INodeNo) -> Res<PathBuf> {
        self.paths.read().unwrap().get(&ino.0).cloned().ok_or(Errno::ESTALE)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Res<PathBuf> {
        Ok(self.path(parent)?.join(name))
    }

    /// The attributes of `path`, remembered under its inode number (a lookup).
    fn entry(&self, path: PathBuf) -> Res<FileAttr> {
        let m = fs::symlink_metadata(&path)?;
        let a = attr(self.ino(m.ino()), &m);
        self.paths.write().unwrap().insert(a.ino.0, path);
        Ok(a)
    }

    fn file(&self, fh: FileHandle) -> Res<Arc<File>> {
        self.files.read().unwrap().get(&fh.0).map(|o| o.file.clone()).ok_or(Errno::EBADF)
    }

    fn getattr(&self, ino: INodeNo, fh: Option<FileHandle>) -> Res<FileAttr> {
        let m = match fh.and_then(|fh| self.file(fh).ok()) {
            Some(f) => f.metadata()?,
            None => fs::symlink_metadata(self.path(ino)?)?,
        };
        Ok(attr(ino.0, &m))
    }

    /// Opens `path` for an open or create with kernel `flags`. With the writeback cache the
    /// kernel reads pages of write-only files and does appends itself; with passthrough one
    /// backing file serves every open of an inode: so both open read-write, without O_APPEND.
    fn open_file(&self, path: &Path, flags: i32, mode: u32) -> io::Result<File> {
        let acc = flags & libc::O_ACCMODE;
        let rest = flags & !(libc::O_ACCMODE | libc::O_NOCTTY);
        let open = |read: bool, write: bool, rest: i32| {
            OpenOptions::new().read(read).write(write).mode(mode).custom_flags(rest).open(path)
        };
        let shared = self.status.passthrough.load(Relaxed) || self.status.writeback.load(Relaxed);
        if shared {
            if let Ok(f) = open(true, true, rest & !libc::O_APPEND) {
                return Ok(f);
            }
        }
        open(acc != libc::O_WRONLY, acc != libc::O_RDONLY, rest)
    }

    /// A new handle for `file` of inode `ino` and, with passthrough, the inode's backing id
    /// (registered by `open_backing` when it has none).
    fn register(
        &self,
        ino: u64,
        file: File,
        open_backing: impl FnOnce(&File) -> io::Result<BackingId>,
    ) -> (FileHandle, Option<Arc<BackingId>>) {
        let mut backing = None;
        if self.status.passthrough.load(Relaxed) {
            let mut ids = self.backing.lock().unwrap();
            match ids.get(&ino).and_then(Weak::upgrade) {
                Some(id) => backing = Some(id),
                None => match open_backing(&file) {
                    Ok(id) => {
                        let id = Arc::new(id);
                        ids.insert(ino, Arc::downgrade(&id));
                        backing = Some(id);
                    }
                    Err(e) => self.status.not_passthrough(format!("registering a backing file failed: {e}")),
                },
            }
        }
        let counter = if backing.is_some() { &self.status.passthrough_opens } else { &self.status.cached_opens };
        counter.fetch_add(1, Relaxed);
        let fh = self.next_fh.fetch_add(1, Relaxed);
        let open = Open { ino, file: Arc::new(file), backing: backing.clone() };
        self.files.write().unwrap().insert(fh, open);
        (FileHandle(fh), backing)
    }

    fn opendir(&self, ino: INodeNo) -> Res<FileHandle> {
        let path = self.path(ino)?;
        let dot = |name: &str| DirEnt { ino: ino.0, kind: FileType::Directory, name: name.into() };
        let mut ents = vec![dot("."), dot("..")];
        for e in fs::read_dir(&path)? {
            let e = e?;
            let kind = FileType::from_std(e.file_type()?).unwrap_or(FileType::RegularFile);
            ents.push(DirEnt { ino: self.ino(e.ino()), kind, name: e.file_name() });
        }
        let fh = self.next_fh.fetch_add(1, Relaxed);
        self.dirs.lock().unwrap().insert(fh, Arc::new(ents));
        Ok(FileHandle(fh))
    }

    fn dir(&self, fh: FileHandle) -> Res<Arc<Vec<DirEnt>>> {
        self.dirs.lock().unwrap().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    fn rename(&self, old: PathBuf, new: PathBuf, flags: RenameFlags) -> Res<()> {
        if flags.contains(RenameFlags::RENAME_EXCHANGE) || flags.contains(RenameFlags::RENAME_WHITEOUT) {
            return Err(Errno::EINVAL);
        }
        let (o, n) = (cstr(&old)?, cstr(&new)?);
        // SAFETY: both paths are NUL-terminated and outlive the call.
        check(unsafe { libc::renameat2(libc::AT_FDCWD, o.as_ptr(), libc::AT_FDCWD, n.as_ptr(), flags.bits()) })?;
        for p in self.paths.write().unwrap().values_mut() {
            if let Ok(rest) = p.strip_prefix(&old) {
                *p = if rest.as_os_str().is_empty() { new.clone() } else { new.join(rest) };
            }
        }
        Ok(())
    }

    fn statfs(&self) -> io::Result<libc::statvfs> {
        let root = cstr(&self.path(INodeNo(1)).map_err(|_| io::Error::from_raw_os_error(libc::ESTALE))?)?;
        // SAFETY: statvfs is plain old data, for which all zeroes is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `root` is NUL-terminated and `st` a valid statvfs to fill; both outlive the call.
        check(unsafe { libc::statvfs(root.as_ptr(), &mut st) })?;
        Ok(st)
    }
}

macro_rules! answer {
    ($reply:expr, $res:expr, |$v:pat_param| $ok:expr) => {
        match $res {
            Ok($v) => $ok,
            Err(e) => $reply.error(e),
        }
    };
}

impl Filesystem for Probe {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let add = |config: &mut KernelConfig, flag| config.add_capabilities(flag).is_ok();
        self.status.readdirplus.store(add(config, InitFlags::FUSE_DO_READDIRPLUS), Relaxed);
        add(config, InitFlags::FUSE_PARALLEL_DIROPS);
        let passthrough = self.want_passthrough
            && match (add(config, InitFlags::FUSE_PASSTHROUGH), config.set_max_stack_depth(2)) {
                (true, Ok(_)) => true,
                (false, _) => {
                    self.status.not_passthrough("the kernel does not offer FUSE_PASSTHROUGH".into());
                    false
                }
                (true, Err(max)) => {
                    self.status.not_passthrough(format!("the kernel allows a stacking depth of {max} only"));
                    false
                }
            };
        self.status.passthrough.store(passthrough, Relaxed);
        // The kernel turns passthrough off when the writeback cache is asked for too.
        if !passthrough {
            self.status.writeback.store(add(config, InitFlags::FUSE_WRITEBACK_CACHE), Relaxed);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        answer!(reply, self.child(parent, name).and_then(|p| self.entry(p)), |a| reply.entry(&TTL, &a, Generation(0)))
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        answer!(reply, self.getattr(ino, fh), |a| reply.attr(&TTL, &a))
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let res = || -> Res<FileAttr> {
            let path = self.path(ino)?;
            if let Some(mode) = mode {
                fs::set_permissions(&path, fs::Permissions::from_mode(mode & 0o7777))?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::lchown(&path, uid, gid)?;
            }
            if let Some(size) = size {
                match fh.and_then(|fh| self.file(fh).ok()) {
                    Some(f) => f.set_len(size)?,
                    None => OpenOptions::new().write(true).open(&path)?.set_len(size)?,
                }
            }
            if atime.is_some() || mtime.is_some() {
                utimens(&path, atime, mtime)?;
            }
            self.getattr(ino, fh)
        };
        answer!(reply, res(), |a| reply.attr(&TTL, &a))
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let res = self.child(parent, name).and_then(|p| {
            fs::DirBuilder::new().mode(mode & !umask).create(&p)?;
            self.entry(p)
        });
        answer!(reply, res, |a| reply.entry(&TTL, &a, Generation(0)))
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer!(reply, self.child(parent, name).and_then(|p| Ok(fs::remove_file(p)?)), |()| reply.ok())
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer!(reply, self.child(parent, name).and_then(|p| Ok(fs::remove_dir(p)?)), |()| reply.ok())
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let res = self.child(parent, name).and_then(|o| self.rename(o, self.child(newparent, newname)?, flags));
        answer!(reply, res, |()| reply.ok())
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let file = self.path(ino).and_then(|p| Ok(self.open_file(&p, flags.0, 0)?));
        answer!(reply, file, |file| match self.register(ino.0, file, |f| reply.open_backing(f)) {
            (fh, Some(id)) => reply.opened_passthrough(fh, FopenFlags::empty(), &id),
            (fh, None) => reply.opened(fh, FopenFlags::FOPEN_KEEP_CACHE),
        })
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let res = self.child(parent, name).and_then(|p| {
            let file = self.open_file(&p, flags | libc::O_CREAT, mode & !umask)?;
            let a = attr(self.ino(file.metadata()?.ino()), &file.metadata()?);
            self.paths.write().unwrap().insert(a.ino.0, p);
            Ok((a, file))
        });
        answer!(reply, res, |(a, file)| match self.register(a.ino.0, file, |f| reply.open_backing(f)) {
            (fh, Some(id)) => reply.created_passthrough(&TTL, &a, Generation(0), fh, FopenFlags::empty(), &id),
            (fh, None) => reply.created(&TTL, &a, Generation(0), fh, FopenFlags::FOPEN_KEEP_CACHE),
        })
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let res = self.file(fh).and_then(|f| {
            let (mut buf, mut n) = (vec![0; size as usize], 0);
            while n < buf.len() {
                match f.read_at(&mut buf[n..], offset + n as u64)? {
                    0 => break,
                    got => n += got,
                }
            }
            buf.truncate(n);
            Ok(buf)
        });
        answer!(reply, res, |buf| reply.data(&buf))
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let res = self.file(fh).and_then(|f| Ok(f.write_all_at(data, offset)?));
        answer!(reply, res, |()| reply.written(data.len() as u32))
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let open = self.files.write().unwrap().remove(&fh.0);
        if let Some(Open { ino, backing: Some(id), .. }) = open {
            // Under the lock that opens take: the inode's last handle forgets its backing id.
            let mut ids = self.backing.lock().unwrap();
            drop(id);
            if ids.get(&ino).is_some_and(|w| w.strong_count() == 0) {
                ids.remove(&ino);
            }
        }
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let res = self.file(fh).and_then(|f| Ok(if datasync { f.sync_data() } else { f.sync_all() }?));
        answer!(reply, res, |()| reply.ok())
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        answer!(reply, self.opendir(ino), |fh| reply.opened(fh, FopenFlags::empty()))
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        answer!(reply, self.dir(fh), |ents| {
            for (i, e) in ents.iter().enumerate().skip(offset as usize) {
                if reply.add(INodeNo(e.ino), i as u64 + 1, e.kind, &e.name) {
                    break;
                }
            }
            reply.ok()
        })
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let res = self.dir(fh).and_then(|ents| Ok((ents, self.path(ino)?, self.getattr(ino, None)?)));
        answer!(reply, res, |(ents, dir, dir_attr)| {
            for (i, e) in ents.iter().enumerate().skip(offset as usize) {
                // The kernel links no "." or "..": they carry the directory's own attributes.
                let a = if i < 2 {
                    dir_attr
                } else if let Ok(a) = self.entry(dir.join(&e.name)) {
                    a
                } else {
                    continue;
                };
                if reply.add(a.ino, i as u64 + 1, &e.name, &TTL, &a, Generation(0)) {
                    break;
                }
            }
            reply.ok()
        })
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        self.dirs.lock().unwrap().remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        answer!(reply, self.statfs().map_err(Errno::from), |s| reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            s.f_namemax as u32,
            s.f_frsize as u32,
        ))
    }
}

/// A JSON string (the probe's messages are short ASCII).
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' | '\\' => out.extend(['\\', c]),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out + "\""
}

/// Blocks SIGTERM and SIGINT in this thread and the threads it starts later, so that only
/// [`wait_for_signal`] takes them.
fn block_signals() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain old data, for which all zeroes is a valid value.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t, the signal numbers are valid, and a null old-mask
    // pointer is allowed; blocking the signals only changes how they are delivered.
    let rc = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if rc == 0 {
        Ok(set)
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Returns once a signal of `set` is pending, or `done()` (checked every 200 ms).
fn wait_for_signal(set: &libc::sigset_t, done: impl Fn() -> bool) {
    let tick = libc::timespec { tv_sec: 0, tv_nsec: 200_000_000 };
    // SAFETY: `set` and `tick` are valid for the call; a null siginfo pointer is allowed.
    while !done() && unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &tick) } < 0 {}
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("branchbox-fuse-probe: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> io::Result<()> {
    let status = Arc::new(Status::default());
    let fs = Probe::new(&args.source, args.passthrough, status.clone())?;
    let mut cfg = Config::default();
    cfg.mount_options = vec![MountOption::FSName("branchbox-fuse-probe".into()), MountOption::DefaultPermissions];
    cfg.n_threads = Some(args.threads.max(1));
    cfg.clone_fd = true;
    // Before the serving threads start, so that they inherit the mask.
    let signals = block_signals()?;
    let session = Session::new(fs, &args.mountpoint, &cfg)?.spawn()?;
    let why = status.why_not_passthrough.lock().unwrap().clone();
    let mode = if status.passthrough.load(Relaxed) { "passthrough" } else { "cached" };
    println!(
        "{{\"event\": \"mounted\", \"mode\": \"{mode}\", \"passthrough_requested\": {}, \"writeback_cache\": {}, \
         \"readdirplus\": {}, \"threads\": {}, \"why_not_passthrough\": {}}}",
        args.passthrough,
        status.writeback.load(Relaxed),
        status.readdirplus.load(Relaxed),
        args.threads.max(1),
        why.as_deref().map_or("null".into(), json_str),
    );
    wait_for_signal(&signals, || session.guard.is_finished());
    let res = session.umount_and_join();
    let why = status.why_not_passthrough.lock().unwrap().clone();
    println!(
        "{{\"event\": \"unmounted\", \"passthrough_opens\": {}, \"cached_opens\": {}, \"why_not_passthrough\": {}}}",
        status.passthrough_opens.load(Relaxed),
        status.cached_opens.load(Relaxed),
        why.as_deref().map_or("null".into(), json_str),
    );
    res
}
