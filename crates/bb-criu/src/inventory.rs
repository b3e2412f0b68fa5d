//! Marking a dumped tree's user and mount namespaces as CRIU's own, so that a restore joins the
//! sandbox's (`--join-ns user`, `--join-ns mnt`) instead of making new ones.
//!
//! CRIU decides which namespaces to create at restore by comparing the root task's namespace ids
//! (`ids-<pid>.img`) with its own at dump time (`root_ids` in `inventory.img`). The dump runs in
//! the sandbox's pid, net, uts, ipc and cgroup namespaces but the host's user and mount
//! namespaces (see the crate doc), so those two differ; here `root_ids` takes the tree's ids for
//! them. Images are protobuf messages after a magic; only two varint fields of one nested
//! message change, everything else is copied byte for byte.

use crate::{CriuError, Result};
use std::path::Path;

/// CRIU's image magics: a file starts with one image magic, or with this common magic and then
/// the image's own.
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;

/// `inventory_entry.root_ids` and `core_entry`-independent `task_kobj_ids_entry` field numbers.
const INVENTORY_ROOT_IDS: u64 = 3;
const IDS_MNT_NS: u64 = 9;
const IDS_USER_NS: u64 = 10;

fn bad(dir: &Path, problem: impl Into<String>) -> CriuError {
    CriuError::Image { dir: dir.to_path_buf(), problem: problem.into() }
}

fn read_varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// One field of a protobuf message: number, wire type, and its bytes (value only).
struct Field<'a> {
    number: u64,
    wire: u8,
    value: &'a [u8],
}

fn fields(msg: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < msg.len() {
        let key = read_varint(msg, &mut i)?;
        let (number, wire) = (key >> 3, (key & 7) as u8);
        let start = i;
        let end = match wire {
            0 => {
                read_varint(msg, &mut i)?;
                i
            }
            1 => i + 8,
            2 => {
                let len = read_varint(msg, &mut i)? as usize;
                let s = i;
                i = s.checked_add(len)?;
                out.push(Field { number, wire, value: msg.get(s..i)? });
                continue;
            }
            5 => i + 4,
            _ => return None,
        };
        i = end;
        out.push(Field { number, wire, value: msg.get(start..end)? });
    }
    Some(out)
}

fn encode(fields: &[(u64, u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (number, wire, value) in fields {
        write_varint(&mut out, (number << 3) | u64::from(*wire));
        if *wire == 2 {
            write_varint(&mut out, value.len() as u64);
        }
        out.extend_from_slice(value);
    }
    out
}

/// The magic bytes of an image file and its entries (length-prefixed messages).
fn split_image(data: &[u8]) -> Option<(usize, Vec<&[u8]>)> {
    let word = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let head = match word(0)? {
        IMG_COMMON_MAGIC | IMG_SERVICE_MAGIC => 8,
        _ => 4,
    };
    let mut entries = Vec::new();
    let mut at = head;
    while at < data.len() {
        let len = word(at)? as usize;
        entries.push(data.get(at + 4..at + 4 + len)?);
        at += 4 + len;
    }
    Some((head, entries))
}

/// Varint field `number` of `msg`.
fn varint_field(msg: &[u8], number: u64) -> Option<u64> {
    let f = fields(msg)?.into_iter().find(|f| f.number == number && f.wire == 0)?;
    read_varint(f.value, &mut 0)
}

/// `msg` with varint fields set as `set` says (added when missing), the rest unchanged.
fn with_varints(msg: &[u8], set: &[(u64, u64)]) -> Option<Vec<u8>> {
    let mut out: Vec<(u64, u8, Vec<u8>)> = Vec::new();
    for f in fields(msg)? {
        if f.wire == 0 && set.iter().any(|(n, _)| *n == f.number) {
            continue;
        }
        out.push((f.number, f.wire, f.value.to_vec()));
    }
    for (n, v) in set {
        let mut b = Vec::new();
        write_varint(&mut b, *v);
        out.push((*n, 0, b));
    }
    Some(encode(&out))
}

/// In the image in `dir` of a tree rooted at sandbox pid `root_ns_pid`, make the root's user and
/// mount namespaces CRIU's own (see the module doc).
pub fn adopt_namespaces(dir: &Path, root_ns_pid: i32) -> Result<()> {
    let ids_path = dir.join(format!("ids-{root_ns_pid}.img"));
    let ids = std::fs::read(&ids_path).map_err(CriuError::io(format!("read {}", ids_path.display())))?;
    let (_, entries) = split_image(&ids).ok_or_else(|| bad(dir, "unreadable ids image"))?;
    let task = entries.first().ok_or_else(|| bad(dir, "empty ids image"))?;
    let mnt = varint_field(task, IDS_MNT_NS).ok_or_else(|| bad(dir, "ids image without a mount namespace"))?;
    let user = varint_field(task, IDS_USER_NS).ok_or_else(|| bad(dir, "ids image without a user namespace"))?;

    let inv_path = dir.join("inventory.img");
    let inv = std::fs::read(&inv_path).map_err(CriuError::io(format!("read {}", inv_path.display())))?;
    let (head, entries) = split_image(&inv).ok_or_else(|| bad(dir, "unreadable inventory"))?;
    let [entry] = entries.as_slice() else { return Err(bad(dir, "inventory with more than one entry")) };
    let mut out_fields = Vec::new();
    let mut patched = false;
    for f in fields(entry).ok_or_else(|| bad(dir, "unreadable inventory entry"))? {
        let mut value = f.value.to_vec();
        if f.number == INVENTORY_ROOT_IDS && f.wire == 2 {
            value = with_varints(f.value, &[(IDS_MNT_NS, mnt), (IDS_USER_NS, user)])
                .ok_or_else(|| bad(dir, "unreadable root ids in the inventory"))?;
            patched = true;
        }
        out_fields.push((f.number, f.wire, value));
    }
    if !patched {
        return Err(bad(dir, "inventory without root ids"));
    }
    let msg = encode(&out_fields);
    let mut out = inv[..head].to_vec();
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&msg);
    let tmp = dir.join("inventory.img.tmp");
    std::fs::write(&tmp, &out).map_err(CriuError::io("write the inventory"))?;
    std::fs::rename(&tmp, &inv_path).map_err(CriuError::io("write the inventory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(mnt: u64, user: u64) -> Vec<u8> {
        // vm 1, files 2, fs 3, sighand 4, pid ns 5, net 6, ... mnt (9), user (10), cgroup (11).
        encode(&[
            (1, 0, vec![1]),
            (2, 0, vec![2]),
            (3, 0, vec![3]),
            (4, 0, vec![4]),
            (5, 0, vec![5]),
            (9, 0, {
                let mut b = Vec::new();
                write_varint(&mut b, mnt);
                b
            }),
            (10, 0, {
                let mut b = Vec::new();
                write_varint(&mut b, user);
                b
            }),
            (11, 0, vec![8]),
        ])
    }

    fn image(head: &[u32], entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out: Vec<u8> = head.iter().flat_map(|m| m.to_le_bytes()).collect();
        for e in entries {
            out.extend_from_slice(&(e.len() as u32).to_le_bytes());
            out.extend_from_slice(e);
        }
        out
    }

    #[test]
    fn root_ids_take_the_tree_roots_user_and_mount_namespaces_and_nothing_else_changes() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("ids-7.img"), image(&[IMG_COMMON_MAGIC, 0x1234], &[ids(300, 131)])).unwrap();
        let run_id = encode(&[(13, 2, b"run-id".to_vec())]);
        let inv = encode(&[(1, 0, vec![2]), (3, 2, ids(6, 7)), (4, 0, vec![1]), (13, 2, b"run-id".to_vec())]);
        std::fs::write(d.path().join("inventory.img"), image(&[0x5831_3116], &[inv])).unwrap();
        adopt_namespaces(d.path(), 7).unwrap();
        let data = std::fs::read(d.path().join("inventory.img")).unwrap();
        let (head, entries) = split_image(&data).unwrap();
        assert_eq!(head, 4);
        assert_eq!(&data[..4], &0x5831_3116u32.to_le_bytes());
        let f = fields(entries[0]).unwrap();
        let root = f.iter().find(|f| f.number == 3).unwrap().value;
        assert_eq!(varint_field(root, IDS_MNT_NS), Some(300));
        assert_eq!(varint_field(root, IDS_USER_NS), Some(131));
        assert_eq!(varint_field(root, 11), Some(8), "other ids kept");
        assert_eq!(varint_field(entries[0], 1), Some(2));
        assert!(
            encode(&[(13, 2, b"run-id".to_vec())]) == run_id
                && f.iter().any(|f| f.number == 13 && f.value == b"run-id")
        );
    }

    #[test]
    fn a_broken_image_is_an_error_not_a_panic() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("ids-7.img"), [0x19, 0x43]).unwrap();
        assert!(adopt_namespaces(d.path(), 7).is_err());
        assert!(adopt_namespaces(d.path(), 8).is_err(), "missing file");
    }
}
