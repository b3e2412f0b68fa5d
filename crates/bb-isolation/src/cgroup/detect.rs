//! Finding the cgroup hierarchies from /proc/self/mountinfo.

use std::fs;
use std::path::{Path, PathBuf};

use super::{CgroupLayout, CgroupVersion, V1_CONTROLLERS, V2_CONTROLLERS};
use crate::error::{IsolationError, Result};

/// One line of /proc/self/mountinfo, reduced to what detection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MountEntry {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub super_options: Vec<String>,
}

/// Parse mountinfo (proc(5)): `id parent maj:min root mount_point opts [optional...] - fstype
/// source super_opts`. Octal escapes (`\040` for space) in the mount point are decoded.
pub(crate) fn parse_mountinfo(text: &str) -> std::result::Result<Vec<MountEntry>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(' ').collect();
        let sep = fields
            .iter()
            .position(|f| *f == "-")
            .ok_or_else(|| format!("line {}: no ' - ' separator: {line:?}", n + 1))?;
        if sep < 6 || fields.len() < sep + 4 {
            return Err(format!("line {}: too few fields: {line:?}", n + 1));
        }
        out.push(MountEntry {
            mount_point: PathBuf::from(unescape(fields[4])),
            fs_type: fields[sep + 1].to_owned(),
            super_options: fields[sep + 3].split(',').map(str::to_owned).collect(),
        });
    }
    Ok(out)
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c));
        let value = octal.then(|| b[i + 1..i + 4].iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0')));
        if let Some(v) = value.and_then(|v| u8::try_from(v).ok()) {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Pick the layout: v2 if a cgroup2 mount offers memory, cpu and pids in its cgroup.controllers,
/// else v1 with the memory, cpu, pids and freezer hierarchies.
pub(crate) fn layout_from_mountinfo(text: &str, source: &Path, parent: &str) -> Result<CgroupLayout> {
    let mounts = parse_mountinfo(text).map_err(|detail| IsolationError::Parse { path: source.to_owned(), detail })?;

    let mut v2_notes = Vec::new();
    for m in mounts.iter().filter(|m| m.fs_type == "cgroup2") {
        let file = m.mount_point.join("cgroup.controllers");
        match fs::read_to_string(&file) {
            Ok(text) => {
                let have: Vec<&str> = text.split_whitespace().collect();
                if V2_CONTROLLERS.iter().all(|c| have.contains(c)) {
                    return Ok(CgroupLayout::with_roots(
                        CgroupVersion::V2,
                        vec![("unified".to_owned(), m.mount_point.clone())],
                        parent,
                    ));
                }
                v2_notes.push(format!("cgroup2 at {} offers only [{}]", m.mount_point.display(), have.join(" ")));
            }
            Err(e) => v2_notes.push(format!("cannot read {}: {e}", file.display())),
        }
    }
    if v2_notes.is_empty() {
        v2_notes.push("no cgroup2 mount".to_owned());
    }

    let mut roots = Vec::new();
    let mut missing = Vec::new();
    for controller in V1_CONTROLLERS {
        let found = mounts.iter().find(|m| m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == controller));
        match found {
            Some(m) => roots.push((controller.to_owned(), m.mount_point.clone())),
            None => missing.push(controller),
        }
    }
    if missing.is_empty() {
        return Ok(CgroupLayout::with_roots(CgroupVersion::V1, roots, parent));
    }
    Err(IsolationError::CgroupsUnavailable {
        reason: format!(
            "cgroup v2 is not usable ({}; it needs {}), and the cgroup v1 controller(s) [{}] are \
             not mounted. Boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1) or mount the \
             v1 controllers, e.g. `mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup \
             /sys/fs/cgroup/{c}`",
            v2_notes.join("; "),
            V2_CONTROLLERS.join("+"),
            missing.join(" "),
            c = missing[0],
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const THIS_MACHINE: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn parses_fields_optional_tags_and_escapes() {
        let text =
            "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 shared:2 - ext3 /dev/root rw,errors=continue\n";
        let m = parse_mountinfo(text).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/with space"));
        assert_eq!(m[0].fs_type, "ext3");
        assert_eq!(m[0].super_options, vec!["rw", "errors=continue"]);
        assert!(parse_mountinfo("1 2 3\n").is_err());
    }

    #[test]
    fn v1_when_unified_has_no_controllers() {
        // /sys/fs/cgroup/unified/cgroup.controllers is empty or absent wherever this runs (a v2
        // host has no such mount), so the cgroup2 line cannot qualify.
        let layout = layout_from_mountinfo(THIS_MACHINE, Path::new("mountinfo"), "bb").unwrap();
        assert_eq!(layout.version(), CgroupVersion::V1);
        let roots: Vec<(&str, &str)> = layout.roots().iter().map(|(c, p)| (c.as_str(), p.to_str().unwrap())).collect();
        assert_eq!(
            roots,
            vec![
                ("memory", "/sys/fs/cgroup/memory"),
                ("cpu", "/sys/fs/cgroup/cpu"),
                ("pids", "/sys/fs/cgroup/pids"),
                ("freezer", "/sys/fs/cgroup/freezer"),
            ]
        );
    }

    #[test]
    fn v1_with_comounted_cpu_cpuacct() {
        let text = "\
1 0 0:1 / /cg/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
2 0 0:2 / /cg/memory rw - cgroup cgroup rw,memory
3 0 0:3 / /cg/pids rw - cgroup cgroup rw,pids
4 0 0:4 / /cg/freezer rw - cgroup cgroup rw,freezer
";
        let layout = layout_from_mountinfo(text, Path::new("m"), "bb").unwrap();
        assert_eq!(layout.version(), CgroupVersion::V1);
        assert_eq!(layout.hierarchies().len(), 4);
        assert!(layout.roots().contains(&("cpu".to_owned(), PathBuf::from("/cg/cpu,cpuacct"))));
    }

    #[test]
    fn v2_when_unified_offers_controllers() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu io memory hugetlb pids rdma\n").unwrap();
        let text = format!("{THIS_MACHINE}50 31 0:40 / {} rw - cgroup2 cgroup2 rw,nsdelegate\n", dir.path().display());
        let layout = layout_from_mountinfo(&text, Path::new("m"), "bb").unwrap();
        assert_eq!(layout.version(), CgroupVersion::V2);
        assert_eq!(layout.roots(), &[("unified".to_owned(), dir.path().to_owned())]);
    }

    #[test]
    fn v2_without_pids_falls_back_to_v1() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        let text = format!("{THIS_MACHINE}50 31 0:40 / {} rw - cgroup2 cgroup2 rw\n", dir.path().display());
        let layout = layout_from_mountinfo(&text, Path::new("m"), "bb").unwrap();
        assert_eq!(layout.version(), CgroupVersion::V1);
    }

    #[test]
    fn missing_v1_freezer_is_an_actionable_error() {
        let text: String = THIS_MACHINE.lines().filter(|l| !l.contains("freezer")).map(|l| format!("{l}\n")).collect();
        let err = layout_from_mountinfo(&text, Path::new("m"), "bb").unwrap_err().to_string();
        assert!(err.contains("[freezer]"), "{err}");
        assert!(err.contains("mount -t cgroup -o freezer"), "{err}");
        assert!(err.contains("/sys/fs/cgroup/unified"), "{err}");
    }
}
