//! Trees: a directory stored as its files' chunks plus a manifest (../shared/STORAGE.md, "Tree
//! manifests").
//!
//! A tree is an overlayfs layer (whiteouts are 0:0 character devices, opaque directories carry
//! `trusted.overlay.opaque`/`user.overlay.opaque`, any xattrs) or a CRIU image directory (plain
//! files; `pages-*.img` are cut into small chunks, [`ChunkSizes::PAGES`]). The [`Manifest`] has
//! one [`Entry`] per path, sorted by path bytes (so every parent comes before its children and a
//! hard link's first name before its others); it is serialized with postcard and stored as
//! chunks like file contents (compressed, sealed and authenticated under their names).
//!
//! Why postcard: the manifest of a layer with 100,000 files is mostly chunk ids and paths;
//! postcard writes ids as 32 raw bytes and integers as varints, with no field names, which is
//! about half of JSON+zstd with hex ids, and encoding it is deterministic (the same manifest is
//! the same bytes). It is not self-describing, so the manifest starts with [`FORMAT`]; a format
//! change bumps it. [`TreeRef`] itself is a serde type for JSON records (ids as hex there).
//!
//! A tree's id is the keyed hash of its manifest serialized *without chunk locations* (every
//! chunk as if it were an object of its own): which pack a small chunk landed in depends on what
//! the store held at push time, its content does not. So the same content gives the same id from
//! any daemon; the manifest read back is checked against the id.

use crate::{ChunkRef, ChunkSizes, Location, Result, Store, StoreError, MIN_CHUNK};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStoreExt;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags, CWD};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A chunk to write: entry index, offset in its file, the chunk.
type Job = (usize, u64, ChunkRef);
/// Packed chunks closer than this in their pack are read with one range read.
const SPAN_GAP: u64 = 1 << 20;
/// Largest range read of a pack.
const SPAN_MAX: u64 = 32 << 20;

/// Where a packed chunk's sealed bytes are in its pack: [start, end).
fn pack_span(c: &ChunkRef) -> (u64, u64) {
    match c.at {
        Location::Pack { offset, sealed_len, .. } => (offset, offset + sealed_len as u64),
        Location::Own => (0, 0),
    }
}

/// Version of the manifest encoding.
pub const FORMAT: u32 = 1;

/// A stored tree: what a snapshot or volume record keeps.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TreeRef {
    /// Hex keyed hash of the manifest (without chunk locations, see the module docs).
    pub id: String,
    /// The manifest's own chunks, in order.
    pub chunks: Vec<ChunkRef>,
    /// Regular files (hard links counted once) and their content bytes.
    pub files: u64,
    pub bytes: u64,
}

/// What [`Store::get_tree`] wrote: regular files (hard links once) and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    pub files: u64,
    pub bytes: u64,
}

/// A tree's entries, sorted by path bytes, the root (empty path) first.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub format: u32,
    pub entries: Vec<Entry>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Relative path bytes, components joined by `/`; empty for the root.
    pub path: Vec<u8>,
    pub node: Node,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Node {
    Inode(Inode),
    /// Another name of the (non-directory) inode of an earlier entry: a hard link.
    Link {
        target: Vec<u8>,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Inode {
    pub kind: Kind,
    /// Permission bits with setuid/setgid/sticky (`0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// (name, value), sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File {
        chunks: Vec<ChunkRef>,
    },
    Symlink {
        target: Vec<u8>,
    },
    Fifo,
    /// An overlayfs whiteout: a character device 0:0.
    Whiteout,
}

impl Kind {
    /// Content bytes of a file (0 otherwise).
    pub fn size(&self) -> u64 {
        match self {
            Kind::File { chunks } => chunks.iter().map(|c| c.len as u64).sum(),
            _ => 0,
        }
    }
}

impl Manifest {
    /// Regular files (hard links once) and their bytes.
    pub fn stats(&self) -> TreeStats {
        let mut s = TreeStats::default();
        for e in &self.entries {
            if let Node::Inode(Inode { kind: kind @ Kind::File { .. }, .. }) = &e.node {
                s.files += 1;
                s.bytes += kind.size();
            }
        }
        s
    }

    /// Every chunk: the files' contents.
    pub fn chunks(&self) -> impl Iterator<Item = &ChunkRef> {
        self.entries.iter().flat_map(|e| match &e.node {
            Node::Inode(Inode { kind: Kind::File { chunks }, .. }) => chunks.as_slice(),
            _ => &[],
        })
    }

    fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("a manifest always serializes")
    }

    /// The bytes the id hashes: the manifest with every chunk located as its own object.
    fn content_bytes(&self) -> Vec<u8> {
        let mut m = self.clone();
        for e in &mut m.entries {
            if let Node::Inode(Inode { kind: Kind::File { chunks }, .. }) = &mut e.node {
                chunks.iter_mut().for_each(|c| c.at = Location::Own);
            }
        }
        m.encode()
    }

    /// Why this manifest must not be written out, if it must not: the root first and a
    /// directory; every other path relative, without `.`, `..` or empty components, in strictly
    /// increasing order, below a directory entry (so never through a symlink); hard links to an
    /// earlier non-directory inode; ids, times and names the kernel takes as given.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("manifest format {} (this build reads {FORMAT})", self.format));
        }
        match self.entries.first() {
            Some(Entry { path, node: Node::Inode(Inode { kind: Kind::Dir, .. }) }) if path.is_empty() => {}
            _ => return Err("the first entry is not the root directory".into()),
        }
        // The entries so far, by path.
        let mut seen: HashMap<&[u8], &Node> = HashMap::new();
        let mut last: &[u8] = &[];
        for (i, e) in self.entries.iter().enumerate() {
            let shown = String::from_utf8_lossy(&e.path);
            let bad = |why: &str| Err(format!("entry `{shown}` {why}"));
            if i > 0 {
                check_path(&e.path).map_err(|why| format!("entry `{shown}` {why}"))?;
                if e.path.as_slice() <= last {
                    return bad("is out of order or repeated");
                }
                let parent = parent_of(&e.path);
                match seen.get(parent) {
                    Some(Node::Inode(Inode { kind: Kind::Dir, .. })) => {}
                    Some(Node::Inode(Inode { kind: Kind::Symlink { .. }, .. })) => {
                        return bad("goes through a symlink");
                    }
                    Some(_) => return bad("is below a non-directory"),
                    None => return bad("has no parent directory entry"),
                }
            }
            match &e.node {
                Node::Link { target } => match seen.get(target.as_slice()) {
                    Some(Node::Inode(Inode { kind: Kind::Dir, .. })) => return bad("is a hard link to a directory"),
                    Some(Node::Inode(_)) => {}
                    Some(Node::Link { .. }) => return bad("is a hard link to a hard link entry"),
                    None => return bad("is a hard link to no earlier entry"),
                },
                Node::Inode(n) => {
                    if n.mode & !0o7777 != 0 {
                        return bad("has a mode with file type bits");
                    }
                    if n.uid == u32::MAX || n.gid == u32::MAX {
                        return bad("has owner id -1");
                    }
                    if n.mtime_nsec >= 1_000_000_000 {
                        return bad("has an mtime with 1e9 or more nanoseconds");
                    }
                    if n.xattrs.iter().any(|(k, _)| k.is_empty() || k.contains(&0)) {
                        return bad("has an xattr name that is empty or holds NUL");
                    }
                    if let Kind::Symlink { target } = &n.kind {
                        if target.is_empty() || target.contains(&0) {
                            return bad("is a symlink whose target is empty or holds NUL");
                        }
                    }
                }
            }
            seen.insert(&e.path, &e.node);
            last = &e.path;
        }
        Ok(())
    }
}

/// A relative path of normal components.
fn check_path(p: &[u8]) -> std::result::Result<(), &'static str> {
    if p.first() == Some(&b'/') {
        return Err("is an absolute path");
    }
    for c in p.split(|b| *b == b'/') {
        match c {
            b"" => return Err("has an empty path component"),
            b"." => return Err("has a `.` path component"),
            b".." => return Err("escapes through `..`"),
            _ if c.contains(&0) => return Err("holds NUL"),
            _ => {}
        }
    }
    Ok(())
}

fn parent_of(p: &[u8]) -> &[u8] {
    p.iter().rposition(|b| *b == b'/').map_or(&[], |i| &p[..i])
}

fn name_of(p: &[u8]) -> &[u8] {
    p.iter().rposition(|b| *b == b'/').map_or(p, |i| &p[i + 1..])
}

/// `p` as a path relative to a directory fd ("." for the root).
fn rel(p: &[u8]) -> &Path {
    if p.is_empty() {
        Path::new(".")
    } else {
        Path::new(OsStr::from_bytes(p))
    }
}

/// What the walk found at one path (file contents not read yet).
struct Found {
    path: Vec<u8>,
    inode: Inode,
    dev: u64,
    ino: u64,
    nlink: u64,
}

/// Walk `root` without following symlinks or descending into other filesystems (a mount point
/// is kept as an empty directory). Sockets and device nodes other than whiteouts are skipped.
fn walk(root: &Path) -> Result<Vec<Found>> {
    let meta = std::fs::symlink_metadata(root).map_err(StoreError::io(format!("inspect {}", root.display())))?;
    if !meta.is_dir() {
        return Err(StoreError::Io {
            what: format!("push tree {}", root.display()),
            source: std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        });
    }
    let root_dev = meta.dev();
    let mut out = Vec::new();
    let mut todo = vec![(Vec::new(), meta)];
    while let Some((path, meta)) = todo.pop() {
        let full = root.join(rel(&path));
        let read = |what: &str| StoreError::io(format!("{what} {}", full.display()));
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            Kind::Dir
        } else if ft.is_file() {
            Kind::File { chunks: Vec::new() }
        } else if ft.is_symlink() {
            Kind::Symlink { target: std::fs::read_link(&full).map_err(read("readlink"))?.into_os_string().into_vec() }
        } else if ft.is_fifo() {
            Kind::Fifo
        } else if ft.is_char_device() && meta.rdev() == 0 {
            Kind::Whiteout
        } else {
            tracing::warn!(path = %full.display(), "not stored: a socket or device node");
            continue;
        };
        let mut xattrs = Vec::new();
        match xattr::list(&full) {
            Ok(names) => {
                for name in names {
                    // Gone meanwhile: not there.
                    if let Some(v) = xattr::get(&full, &name).map_err(read("read xattrs of"))? {
                        xattrs.push((name.into_vec(), v));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {}
            Err(e) => return Err(read("list xattrs of")(e)),
        }
        xattrs.sort();
        if ft.is_dir() {
            if meta.dev() != root_dev {
                tracing::warn!(path = %full.display(), "not descending into another filesystem");
            } else {
                for ent in std::fs::read_dir(&full).map_err(read("read directory"))? {
                    let ent = ent.map_err(read("read directory"))?;
                    let m = ent.metadata().map_err(read("inspect entry of"))?;
                    let mut child = path.clone();
                    if !child.is_empty() {
                        child.push(b'/');
                    }
                    child.extend_from_slice(ent.file_name().as_bytes());
                    todo.push((child, m));
                }
            }
        }
        let inode = Inode {
            kind,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec() as u32,
            xattrs,
        };
        out.push(Found { path, inode, dev: meta.dev(), ino: meta.ino(), nlink: meta.nlink() });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn tree_err(tree: &str, why: impl Into<String>) -> StoreError {
    StoreError::BadTree { tree: tree.to_string(), why: why.into() }
}

/// An I/O error of restoring `path` into `dest`.
fn restore_err(dest: &Path, what: &str, path: &[u8]) -> impl FnOnce(rustix::io::Errno) -> StoreError + use<> {
    let what = format!("restore into {}: {what} /{}", dest.display(), String::from_utf8_lossy(path));
    move |e| StoreError::Io { what, source: e.into() }
}

const STRICT: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

/// Open `path` below `root` with `flags`, crossing no symlink (with `O_PATH|O_NOFOLLOW`, a
/// symlink at the end is opened itself), never leaving `root`.
fn open_beneath(root: &OwnedFd, path: &[u8], flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(root, rel(path), flags | OFlags::CLOEXEC, Mode::empty(), STRICT)
}

fn open_dir(root: &OwnedFd, path: &[u8]) -> rustix::io::Result<OwnedFd> {
    open_beneath(root, path, OFlags::PATH | OFlags::DIRECTORY)
}

/// Make every entry's node below `root` (contents and metadata come later).
fn create_nodes(root: &OwnedFd, dest: &Path, m: &Manifest) -> Result<()> {
    // Entries are sorted: consecutive entries often share their parent.
    let mut parent: Option<(&[u8], OwnedFd)> = None;
    for e in &m.entries[1..] {
        let err = |what| restore_err(dest, what, &e.path);
        let dir_path = parent_of(&e.path);
        let dir = match parent.take() {
            Some((p, fd)) if p == dir_path => fd,
            _ => open_dir(root, dir_path).map_err(err("open parent of"))?,
        };
        let name = Path::new(OsStr::from_bytes(name_of(&e.path)));
        match &e.node {
            Node::Link { target } => {
                let tdir = open_dir(root, parent_of(target)).map_err(err("open link target's parent for"))?;
                let tname = Path::new(OsStr::from_bytes(name_of(target)));
                rustix::fs::linkat(&tdir, tname, &dir, name, AtFlags::empty()).map_err(err("hard-link"))?;
            }
            Node::Inode(n) => match &n.kind {
                Kind::Dir => rustix::fs::mkdirat(&dir, name, Mode::RWXU).map_err(err("mkdir"))?,
                Kind::File { .. } => {
                    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                    rustix::fs::openat(&dir, name, flags, Mode::RUSR | Mode::WUSR).map_err(err("create"))?;
                }
                Kind::Symlink { target } => {
                    rustix::fs::symlinkat(OsStr::from_bytes(target), &dir, name).map_err(err("symlink"))?
                }
                Kind::Fifo => rustix::fs::mknodat(&dir, name, FileType::Fifo, Mode::RUSR | Mode::WUSR, 0)
                    .map_err(err("mkfifo"))?,
                Kind::Whiteout => rustix::fs::mknodat(&dir, name, FileType::CharacterDevice, Mode::empty(), 0)
                    .map_err(err("create whiteout"))?,
            },
        }
        parent = Some((dir_path, dir));
    }
    Ok(())
}

/// Owner, mode, xattrs and times of every inode, deepest entries first (a directory's mtime is
/// set after everything in it was made). Each inode is reached through an `O_PATH|O_NOFOLLOW`
/// fd (a symlink is the symlink itself); what has no `*at` call goes through `/proc/self/fd/N`,
/// which names exactly that inode.
fn set_metadata(root: &OwnedFd, dest: &Path, m: &Manifest) -> Result<()> {
    for e in m.entries.iter().rev() {
        let Node::Inode(n) = &e.node else { continue };
        let err = |what| restore_err(dest, what, &e.path);
        let fd = open_beneath(root, &e.path, OFlags::PATH | OFlags::NOFOLLOW).map_err(err("open"))?;
        let proc = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let (uid, gid) = (rustix::fs::Uid::from_raw(n.uid), rustix::fs::Gid::from_raw(n.gid));
        rustix::fs::chownat(&fd, "", Some(uid), Some(gid), AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW)
            .map_err(err("chown"))?;
        // After chown, which clears setuid/setgid bits and file capabilities.
        if !matches!(n.kind, Kind::Symlink { .. }) {
            rustix::fs::chmodat(CWD, &proc, Mode::from_bits_truncate(n.mode), AtFlags::empty())
                .map_err(err("chmod"))?;
        }
        for (k, v) in &n.xattrs {
            rustix::fs::setxattr(&proc, OsStr::from_bytes(k), v, XattrFlags::empty()).map_err(restore_err(
                dest,
                &format!("set xattr {} on", String::from_utf8_lossy(k)),
                &e.path,
            ))?;
        }
        let t = Timespec { tv_sec: n.mtime, tv_nsec: n.mtime_nsec as _ };
        let times = Timestamps { last_access: t, last_modification: t };
        rustix::fs::utimensat(&fd, "", &times, AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW)
            .map_err(err("set times of"))?;
    }
    Ok(())
}

impl Store {
    /// Store the directory `dir` as a tree (see the module docs): walk it (no symlink followed,
    /// one filesystem), upload file contents up to `concurrency` files at once, each with up to
    /// `concurrency` chunks in flight (chunks the store has are skipped), then the manifest. Durable once it returns: every object it names is
    /// in the store. The same content gives the same [`TreeRef::id`].
    pub async fn put_tree(&self, dir: &Path) -> Result<TreeRef> {
        let root = dir.to_path_buf();
        let found = tokio::task::spawn_blocking(move || walk(&root))
            .await
            .map_err(|e| StoreError::io(format!("walk {}", dir.display()))(std::io::Error::other(e)))??;
        // Hard links: the first name (in path order) is the inode, the others link to it.
        let mut first: HashMap<(u64, u64), usize> = HashMap::new();
        let mut entries = Vec::with_capacity(found.len());
        let mut uploads = Vec::new();
        for (i, f) in found.iter().enumerate() {
            let is_dir = matches!(f.inode.kind, Kind::Dir);
            if !is_dir && f.nlink > 1 {
                if let Some(&j) = first.get(&(f.dev, f.ino)) {
                    entries.push(Entry { path: f.path.clone(), node: Node::Link { target: found[j].path.clone() } });
                    continue;
                }
                first.insert((f.dev, f.ino), i);
            }
            if matches!(f.inode.kind, Kind::File { .. }) {
                uploads.push((entries.len(), i));
            }
            entries.push(Entry { path: f.path.clone(), node: Node::Inode(f.inode.clone()) });
        }
        let packer = self.packer();
        let contents: Vec<(usize, Vec<ChunkRef>)> = futures::stream::iter(uploads)
            .map(|(at, i)| {
                let (f, packer) = (&found[i], &packer);
                async move {
                    let path = dir.join(rel(&f.path));
                    let shown = path.display().to_string();
                    let file = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_NOFOLLOW)
                        .open(&path)
                        .map_err(StoreError::io(format!("open {shown}")))?;
                    let m = file.metadata().map_err(StoreError::io(format!("inspect {shown}")))?;
                    if (m.dev(), m.ino()) != (f.dev, f.ino) {
                        return Err(StoreError::io(format!("push {shown}"))(std::io::Error::other(
                            "replaced while the tree was pushed",
                        )));
                    }
                    let sizes = ChunkSizes::for_file(OsStr::from_bytes(name_of(&f.path)));
                    Ok((at, self.put_open_file(file, shown, packer, sizes).await?))
                }
            })
            .buffer_unordered(self.concurrency)
            .try_collect()
            .await?;
        for (at, chunks) in contents {
            if let Node::Inode(Inode { kind: Kind::File { chunks: c }, .. }) = &mut entries[at].node {
                *c = chunks;
            }
        }
        let manifest = Manifest { format: FORMAT, entries };
        let id = self.keys.chunk_id(&manifest.content_bytes()).to_string();
        let bytes = manifest.encode();
        let pieces = fastcdc::v2020::FastCDC::new(
            &bytes,
            ChunkSizes::DEFAULT.min as usize,
            ChunkSizes::DEFAULT.avg as usize,
            ChunkSizes::DEFAULT.max as usize,
        );
        let mut chunks = Vec::new();
        for p in pieces {
            let data = &bytes[p.offset..p.offset + p.length];
            chunks.push(if p.length < MIN_CHUNK as usize {
                packer.add(data).await?
            } else {
                self.put_chunk(data).await?
            });
        }
        packer.finish().await?;
        let stats = manifest.stats();
        Ok(TreeRef { id, chunks, files: stats.files, bytes: stats.bytes })
    }

    /// The manifest of `tree`: its chunks authenticated, its content checked against the id.
    pub async fn get_manifest(&self, tree: &TreeRef) -> Result<Manifest> {
        // Owned items: a stream over references would make callers' futures not provably `Send`.
        let parts: Vec<Vec<u8>> = futures::stream::iter(tree.chunks.clone())
            .map(|c| async move { self.get_chunk(&c).await })
            .buffered(self.concurrency)
            .try_collect()
            .await?;
        let manifest: Manifest =
            postcard::from_bytes(&parts.concat()).map_err(|e| tree_err(&tree.id, format!("manifest: {e}")))?;
        if manifest.format != FORMAT {
            return Err(tree_err(&tree.id, format!("manifest format {} (this build reads {FORMAT})", manifest.format)));
        }
        if self.keys.chunk_id(&manifest.content_bytes()).to_string() != tree.id {
            return Err(tree_err(&tree.id, "the manifest's chunks are another tree's"));
        }
        Ok(manifest)
    }

    /// Write `tree` into `dest`, an existing empty directory (its own owner, mode, xattrs and
    /// times become the tree root's): every entry with its type, mode, owner, mtime (atime the
    /// same), xattrs, symlink target, hard links as links, whiteouts as 0:0 devices; file
    /// contents downloaded `concurrency` chunks at a time. Everything is made through directory
    /// fds that crossed no symlink, never following one in `dest`; a manifest with an unsafe
    /// path is refused before anything is written. On error `dest` holds a partial tree.
    pub async fn get_tree(&self, tree: &TreeRef, dest: &Path) -> Result<TreeStats> {
        let manifest = Arc::new(self.get_manifest(tree).await?);
        manifest.check().map_err(|why| tree_err(&tree.id, why))?;
        let shown = dest.display().to_string();
        let empty = std::fs::read_dir(dest).map_err(StoreError::io(format!("read {shown}")))?.next().is_none();
        if !empty {
            return Err(StoreError::io(format!("restore tree {} into {shown}", tree.id))(std::io::Error::new(
                std::io::ErrorKind::DirectoryNotEmpty,
                "not empty",
            )));
        }
        let root: Arc<OwnedFd> = Arc::new(
            rustix::fs::open(dest, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| StoreError::io(format!("open {shown}"))(e.into()))?,
        );
        let dest = Arc::new(dest.to_path_buf());
        let blocking = |what: &'static str, f: fn(&OwnedFd, &Path, &Manifest) -> Result<()>| {
            let (root, dest, m) = (root.clone(), dest.clone(), manifest.clone());
            async move {
                tokio::task::spawn_blocking(move || f(&root, &dest, &m))
                    .await
                    .map_err(|e| StoreError::io(what)(std::io::Error::other(e)))?
            }
        };
        blocking("create nodes", create_nodes).await?;
        // Contents: every chunk of every file, written at its offset.
        let mut jobs = Vec::new();
        for (i, e) in manifest.entries.iter().enumerate() {
            if let Node::Inode(Inode { kind: Kind::File { chunks }, .. }) = &e.node {
                let mut offset = 0u64;
                for c in chunks {
                    jobs.push((i, offset, *c));
                    offset += c.len as u64;
                }
            }
        }
        // Packed chunks are read a span of their pack at a time (one range read for many small
        // files, not one each); a span ends at a gap of more than `SPAN_GAP` or at `SPAN_MAX`.
        let mut units: Vec<Vec<Job>> = Vec::new();
        let mut by_pack: HashMap<crate::PackId, Vec<Job>> = HashMap::new();
        for job in jobs {
            match job.2.at {
                Location::Own => units.push(vec![job]),
                Location::Pack { pack, .. } => by_pack.entry(pack).or_default().push(job),
            }
        }
        for (_, mut js) in by_pack {
            js.sort_by_key(|j| pack_span(&j.2).0);
            let mut cur: Vec<Job> = Vec::new();
            for j in js {
                let (start, end) = pack_span(&j.2);
                if let (Some(first), Some(last)) = (cur.first(), cur.last()) {
                    if start > pack_span(&last.2).1 + SPAN_GAP || end - pack_span(&first.2).0 > SPAN_MAX {
                        units.push(std::mem::take(&mut cur));
                    }
                }
                cur.push(j);
            }
            if !cur.is_empty() {
                units.push(cur);
            }
        }
        futures::stream::iter(units)
            .map(|unit| {
                let (root, dest, m) = (root.clone(), dest.clone(), manifest.clone());
                async move {
                    let mut data = Vec::with_capacity(unit.len());
                    match unit[0].2.at {
                        Location::Own => data.push(self.get_chunk(&unit[0].2).await?),
                        Location::Pack { pack, .. } => {
                            let start = pack_span(&unit[0].2).0;
                            let end = unit.iter().map(|j| pack_span(&j.2).1).max().unwrap_or(start);
                            let bytes = self.get_pack_range(pack, start, end).await?;
                            for j in &unit {
                                let (s, e) = pack_span(&j.2);
                                data.push(self.open_chunk(&j.2, &bytes[(s - start) as usize..(e - start) as usize])?);
                            }
                        }
                    }
                    tokio::task::spawn_blocking(move || {
                        for ((i, offset, _), data) in unit.iter().zip(data) {
                            let path = &m.entries[*i].path;
                            let err = |what| restore_err(&dest, what, path);
                            let fd =
                                open_beneath(&root, path, OFlags::WRONLY | OFlags::NOFOLLOW).map_err(err("open"))?;
                            std::fs::File::from(fd).write_all_at(&data, *offset).map_err(|e| StoreError::Io {
                                what: format!(
                                    "restore into {}: write /{}",
                                    dest.display(),
                                    String::from_utf8_lossy(path)
                                ),
                                source: e,
                            })?;
                        }
                        Ok::<(), StoreError>(())
                    })
                    .await
                    .map_err(|e| StoreError::io("write file contents")(std::io::Error::other(e)))?
                }
            })
            .buffer_unordered(self.concurrency)
            .try_collect::<()>()
            .await?;
        blocking("set metadata", set_metadata).await?;
        Ok(manifest.stats())
    }

    /// Every object `tree` needs: its manifest's and its files' chunk objects, and for packed
    /// chunks the pack and its index (a collector keeps both).
    pub async fn tree_objects(&self, tree: &TreeRef) -> Result<BTreeSet<String>> {
        let manifest = self.get_manifest(tree).await?;
        let mut keys = BTreeSet::new();
        for c in tree.chunks.iter().chain(manifest.chunks()) {
            match c.at {
                Location::Own => keys.insert(c.id.key()),
                Location::Pack { pack, .. } => keys.insert(pack.key()) | keys.insert(pack.index_key()),
            };
        }
        Ok(keys)
    }

    /// Every object under `chunks/` and `packs/`: key, last modified, size.
    pub async fn list_objects(&self) -> Result<Vec<(String, SystemTime, u64)>> {
        let mut out = Vec::new();
        for prefix in ["chunks", "packs"] {
            let metas: Vec<_> =
                self.inner.list(Some(&ObjectPath::from(prefix))).try_collect().await.map_err(|e| self.backend(e))?;
            out.extend(metas.into_iter().map(|m| {
                let t = m.last_modified;
                let since_epoch = Duration::new(t.timestamp().max(0) as u64, t.timestamp_subsec_nanos());
                (m.location.to_string(), SystemTime::UNIX_EPOCH + since_epoch, m.size)
            }));
        }
        Ok(out)
    }

    /// Delete `keys`, `concurrency` at a time; a key already gone is fine. Returns how many
    /// were deleted (S3 does not say whether a key was there: every key it accepted counts).
    /// Chunks of a deleted pack are forgotten first, so no later push refers to them.
    pub async fn delete_objects(&self, keys: &[String]) -> Result<u64> {
        let packs: BTreeSet<&str> = keys
            .iter()
            .filter(|k| k.starts_with("packs/") && !k.ends_with(".idx"))
            .filter_map(|k| k.rsplit('/').next())
            .collect();
        if !packs.is_empty() {
            self.packed.lock().retain(|_, c| match c.at {
                Location::Pack { pack, .. } => !packs.contains(pack.to_string().as_str()),
                Location::Own => true,
            });
        }
        let deleted: Vec<bool> = futures::stream::iter(keys.iter().cloned())
            .map(|k| async move {
                match self.inner.delete(&ObjectPath::from(k.as_str())).await {
                    Ok(()) => Ok(true),
                    Err(object_store::Error::NotFound { .. }) => Ok(false),
                    Err(e) => Err(self.backend(e)),
                }
            })
            .buffer_unordered(self.concurrency)
            .try_collect()
            .await?;
        Ok(deleted.into_iter().filter(|d| *d).count() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChunkId, PackId};

    fn inode(kind: Kind) -> Node {
        Node::Inode(Inode { kind, mode: 0o755, uid: 0, gid: 0, mtime: 1, mtime_nsec: 0, xattrs: vec![] })
    }

    fn entry(path: &str, node: Node) -> Entry {
        Entry { path: path.as_bytes().to_vec(), node }
    }

    fn manifest(rest: Vec<Entry>) -> Manifest {
        let mut entries = vec![entry("", inode(Kind::Dir))];
        entries.extend(rest);
        Manifest { format: FORMAT, entries }
    }

    fn why(m: &Manifest) -> String {
        m.check().unwrap_err()
    }

    fn chunk(n: u8, at: Location) -> ChunkRef {
        ChunkRef { id: ChunkId([n; 32]), len: 100 + n as u32, at }
    }

    #[test]
    fn a_well_formed_manifest_passes() {
        let m = manifest(vec![
            entry("a", inode(Kind::Dir)),
            entry("a/b", inode(Kind::File { chunks: vec![chunk(1, Location::Own)] })),
            entry("a/c", Node::Link { target: b"a/b".to_vec() }),
            entry("a/s", inode(Kind::Symlink { target: b"../../etc/passwd".to_vec() })),
            entry("a/w", inode(Kind::Whiteout)),
            entry("z", inode(Kind::Fifo)),
        ]);
        m.check().unwrap();
        assert_eq!(m.stats(), TreeStats { files: 1, bytes: 101 });
    }

    #[test]
    fn unsafe_or_malformed_entries_are_refused() {
        let file = || inode(Kind::File { chunks: vec![] });
        for (path, needle) in [
            ("/etc/passwd", "absolute"),
            ("..", "escapes"),
            ("a/../../x", "escapes"),
            ("a/./x", "`.`"),
            ("a//x", "empty path component"),
            ("a/", "empty path component"),
        ] {
            let m = manifest(vec![entry("a", inode(Kind::Dir)), entry(path, file())]);
            assert!(why(&m).contains(needle), "{path}: {}", why(&m));
        }
        let through_symlink =
            manifest(vec![entry("l", inode(Kind::Symlink { target: b"/etc".to_vec() })), entry("l/passwd", file())]);
        assert!(why(&through_symlink).contains("symlink"), "{}", why(&through_symlink));
        let below_file = manifest(vec![entry("f", file()), entry("f/x", file())]);
        assert!(why(&below_file).contains("non-directory"));
        let orphan = manifest(vec![entry("d/x", file())]);
        assert!(why(&orphan).contains("no parent"));
        let twice = manifest(vec![entry("x", file()), entry("x", file())]);
        assert!(why(&twice).contains("repeated"));
        let unsorted = manifest(vec![entry("y", file()), entry("x", file())]);
        assert!(why(&unsorted).contains("out of order"));
        let link_dir = manifest(vec![entry("d", inode(Kind::Dir)), entry("e", Node::Link { target: b"d".to_vec() })]);
        assert!(why(&link_dir).contains("directory"));
        let link_later = manifest(vec![entry("a", Node::Link { target: b"b".to_vec() }), entry("b", file())]);
        assert!(why(&link_later).contains("no earlier"));
        let link_escape = manifest(vec![entry("a", Node::Link { target: b"../etc/passwd".to_vec() })]);
        assert!(why(&link_escape).contains("no earlier"));
        let no_root = Manifest { format: FORMAT, entries: vec![entry("a", inode(Kind::Dir))] };
        assert!(why(&no_root).contains("root"));
        let mut bad_mode = manifest(vec![entry("x", file())]);
        if let Node::Inode(n) = &mut bad_mode.entries[1].node {
            n.mode = 0o100644;
        }
        assert!(why(&bad_mode).contains("mode"));
        let future = Manifest { format: FORMAT + 1, ..manifest(vec![]) };
        assert!(why(&future).contains("format"));
    }

    #[test]
    fn the_content_id_ignores_where_chunks_are() {
        let pack = |n| Location::Pack { pack: PackId([n; 16]), offset: 10, sealed_len: 140 };
        let m1 =
            manifest(vec![entry("f", inode(Kind::File { chunks: vec![chunk(1, pack(1)), chunk(2, Location::Own)] }))]);
        let m2 =
            manifest(vec![entry("f", inode(Kind::File { chunks: vec![chunk(1, pack(2)), chunk(2, Location::Own)] }))]);
        assert_ne!(m1.encode(), m2.encode());
        assert_eq!(m1.content_bytes(), m2.content_bytes());
        let m3 = manifest(vec![entry("f", inode(Kind::File { chunks: vec![chunk(3, pack(1))] }))]);
        assert_ne!(m1.content_bytes(), m3.content_bytes());
        let back: Manifest = postcard::from_bytes(&m1.encode()).unwrap();
        assert_eq!(back, m1);
    }

    #[test]
    fn tree_refs_are_json_with_hex_ids() {
        let t = TreeRef {
            id: "ab".into(),
            chunks: vec![chunk(7, Location::Pack { pack: PackId([9; 16]), offset: 1, sealed_len: 2 })],
            files: 1,
            bytes: 2,
        };
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains(&"07".repeat(32)) && json.contains(&"09".repeat(16)), "{json}");
        assert_eq!(serde_json::from_str::<TreeRef>(&json).unwrap(), t);
        // Binary: ids are raw bytes.
        let bin = postcard::to_stdvec(&t.chunks[0]).unwrap();
        assert!(bin.len() < 60, "{} bytes", bin.len());
        assert_eq!(postcard::from_bytes::<ChunkRef>(&bin).unwrap(), t.chunks[0]);
    }

    #[test]
    fn page_files_get_small_chunks() {
        assert_eq!(ChunkSizes::for_file(OsStr::new("pages-3.img")), ChunkSizes::PAGES);
        assert_eq!(ChunkSizes::for_file(OsStr::new("pagemap-3.img")), ChunkSizes::DEFAULT);
        assert_eq!(ChunkSizes::for_file(OsStr::new("core-1.img")), ChunkSizes::DEFAULT);
        assert!(ChunkSizes::PAGES.valid() && ChunkSizes::DEFAULT.valid());
        assert!(!ChunkSizes { max: 8 << 20, ..ChunkSizes::DEFAULT }.valid());
    }
}
