//! Files a tree uses that CRIU cannot find in its mount namespace: on a detached old root (after
//! a root swap) or on the host (log files the daemon opened). See the crate doc.

use crate::{CriuError, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where an external file is opened again at restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Place {
    /// By the same path in the sandbox's root as it is then (a file of an older root).
    Sandbox,
    /// By the same path on the host (a file the daemon opened for the process).
    Host,
}

impl Place {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Place::Sandbox => "in the sandbox's root",
            Place::Host => "on the host",
        }
    }
}

/// One file outside the tree's mount namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct External {
    /// CRIU's name for it: `file[<mnt_id hex>:<inode hex>]`.
    pub key: String,
    pub path: PathBuf,
    pub place: Place,
    /// Open flags to open it with again (access mode and `O_APPEND`; a mapping or a directory:
    /// read-only).
    pub flags: i32,
    pub dir: bool,
}

impl External {
    /// Open the file again for a restore into the sandbox whose init is `init_pid`. `moved`:
    /// (the dumped sandbox's host dir, this one's): a host file under the first is opened at
    /// the same place under the second, made (empty, with the owner of that dir) if missing.
    pub(crate) fn open_moved(&self, init_pid: i32, moved: Option<(&Path, &Path)>) -> std::io::Result<OwnedFd> {
        use std::os::unix::fs::OpenOptionsExt;
        let relocated = match (self.place, moved) {
            (Place::Host, Some((from, to))) => self.path.strip_prefix(from).ok().map(|rest| (to, to.join(rest))),
            _ => None,
        };
        if let Some((to, path)) = &relocated {
            if !self.dir && !path.exists() {
                let owner = std::fs::metadata(to)?;
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
                std::os::unix::fs::fchown(&f, Some(owner.uid()), Some(owner.gid()))?;
            }
        }
        let path = match self.place {
            Place::Host => relocated.map(|(_, p)| p).unwrap_or_else(|| self.path.clone()),
            // Resolved in the sandbox's root, whatever it is now: /proc/<pid>/root is a magic link.
            Place::Sandbox => {
                Path::new(&format!("/proc/{init_pid}/root")).join(self.path.strip_prefix("/").unwrap_or(&self.path))
            }
        };
        let access = self.flags & libc::O_ACCMODE;
        let mut o = std::fs::OpenOptions::new();
        o.read(access == libc::O_RDONLY || access == libc::O_RDWR)
            .write(access == libc::O_WRONLY || access == libc::O_RDWR)
            .custom_flags((self.flags & libc::O_APPEND) | if self.dir { libc::O_DIRECTORY } else { 0 });
        if access == libc::O_WRONLY && self.flags & libc::O_APPEND != 0 {
            o.append(true);
        }
        o.open(path).map(OwnedFd::from)
    }
}

/// What [`collect`] found: the tree's processes (pids in the sandbox) and its external files.
pub(crate) struct Found {
    pub ns_pids: Vec<i32>,
    pub externals: Vec<External>,
}

/// Mount ids listed in `/proc/<pid>/mountinfo` (`self` for our own namespace).
fn mount_ids(pid: &str) -> Result<HashSet<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(CriuError::io(format!("read mountinfo of {pid}")))?;
    Ok(text.lines().filter_map(|l| l.split_whitespace().next()?.parse().ok()).collect())
}

/// The innermost pid of host process `pid`.
fn ns_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().last()?.parse().ok()
}

/// `pid` and its descendants (host pids), from every thread's `children`.
fn tree(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        i += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(children.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
        }
    }
    out
}

/// `flags:` of `/proc/<pid>/fdinfo/<fd>` (octal).
fn fd_flags(pid: i32, fd: &str) -> Option<i32> {
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    i32::from_str_radix(info.lines().find_map(|l| l.strip_prefix("flags:"))?.trim(), 8).ok()
}

/// (mount id, inode, is a directory) of the file a `/proc` link (`map_files/..`, `fd/N`, `cwd`)
/// points to.
fn identify(link: &Path) -> Option<(u64, u64, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_PATH: identify without opening for I/O (a device, a FIFO, a file we may not read).
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(link).ok()?;
    let meta = f.metadata().ok()?;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", f.as_raw_fd())).ok()?;
    let mnt = info.lines().find_map(|l| l.strip_prefix("mnt_id:"))?.trim().parse().ok()?;
    Some((mnt, meta.ino(), meta.is_dir()))
}

/// The tree rooted at host pid `root` and the files it uses from outside its mount namespace.
pub(crate) fn collect(root: i32) -> Result<Found> {
    let in_tree = mount_ids(&root.to_string())?;
    let on_host = mount_ids("self")?;
    let pids = tree(root);
    let mut externals: BTreeMap<String, External> = BTreeMap::new();
    let mut ns_pids = Vec::new();
    for pid in &pids {
        ns_pids.extend(ns_pid(*pid));
        let proc = PathBuf::from(format!("/proc/{pid}"));
        let mut links: Vec<(PathBuf, Option<String>)> = Vec::new();
        for e in std::fs::read_dir(proc.join("map_files")).into_iter().flatten().flatten() {
            links.push((e.path(), None));
        }
        for e in std::fs::read_dir(proc.join("fd")).into_iter().flatten().flatten() {
            // Only files with a path: sockets, pipes and anonymous inodes are CRIU's business.
            if std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with("/")) {
                links.push((e.path(), Some(e.file_name().to_string_lossy().into_owned())));
            }
        }
        links.push((proc.join("cwd"), None));
        for (link, fd) in links {
            let Some((mnt, ino, dir)) = identify(&link) else { continue };
            if in_tree.contains(&mnt) {
                continue;
            }
            let Ok(target) = std::fs::read_link(&link) else { continue };
            let key = format!("file[{mnt:x}:{ino:x}]");
            let flags = fd.as_deref().and_then(|fd| fd_flags(*pid, fd)).unwrap_or(libc::O_RDONLY);
            let place = if on_host.contains(&mnt) { Place::Host } else { Place::Sandbox };
            let e = externals.entry(key.clone()).or_insert(External { key, path: target, place, flags: 0, dir });
            // Opened for writing by one of its users: opened again so (CRIU reopens it for each
            // user with that user's own flags through /proc/self/fd).
            if flags & libc::O_ACCMODE != libc::O_RDONLY {
                e.flags = flags & (libc::O_ACCMODE | libc::O_APPEND);
            }
        }
    }
    ns_pids.sort_unstable();
    Ok(Found { ns_pids, externals: externals.into_values().collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_files_are_in_our_mount_namespace() {
        // A process's files are all in its own mount tree: nothing is external.
        let found = collect(std::process::id() as i32).unwrap();
        assert!(found.externals.is_empty(), "{:?}", found.externals);
        assert_eq!(found.ns_pids.first().copied(), ns_pid(std::process::id() as i32));
    }

    #[test]
    fn a_host_file_is_opened_again_with_its_access_mode() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log");
        std::fs::write(&p, b"x").unwrap();
        let e = External {
            key: "file[1:2]".into(),
            path: p.clone(),
            place: Place::Host,
            flags: libc::O_WRONLY | libc::O_APPEND,
            dir: false,
        };
        let fd = e.open_moved(1, None).unwrap();
        let mut f = std::fs::File::from(fd);
        std::io::Write::write_all(&mut f, b"y").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"xy", "appended");
    }
}
