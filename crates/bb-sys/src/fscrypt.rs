//! Filesystem-level encryption (fscrypt, `linux/fscrypt.h`): a v2 master key added to a
//! filesystem's keyring, and a v2 policy on a directory so that everything created below it has
//! its contents (AES-256-XTS) and names (AES-256-CTS) encrypted on disk.

use std::os::fd::{AsRawFd, BorrowedFd};

use crate::{check, SysResult};

const FSCRYPT_KEY_SPEC_TYPE_IDENTIFIER: u32 = 2;
const FSCRYPT_POLICY_V2: u8 = 2;
const FSCRYPT_MODE_AES_256_XTS: u8 = 1;
const FSCRYPT_MODE_AES_256_CTS: u8 = 4;
const FSCRYPT_POLICY_FLAGS_PAD_32: u8 = 0x03;

/// Length of a master key.
pub const KEY_LEN: usize = 64;

#[repr(C)]
struct AddKeyArg {
    spec_type: u32,
    spec_reserved: u32,
    identifier: [u8; 16],
    spec_pad: [u8; 16],
    raw_size: u32,
    key_id: u32,
    reserved: [u32; 8],
    raw: [u8; KEY_LEN],
}

#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
struct PolicyV2 {
    version: u8,
    contents_mode: u8,
    filenames_mode: u8,
    flags: u8,
    reserved: [u8; 4],
    identifier: [u8; 16],
}

/// `_IOWR('f', 23, struct fscrypt_add_key_arg)` (the fixed part: 80 bytes).
const FS_IOC_ADD_ENCRYPTION_KEY: libc::c_ulong = 0xc050_6617;
/// `_IOR('f', 19, struct fscrypt_policy_v1)`: takes a v2 policy too (told apart by its version).
const FS_IOC_SET_ENCRYPTION_POLICY: libc::c_ulong = 0x800c_6613;

/// Add master key `key` to the keyring of the filesystem `mnt` is on (idempotent). Returns the
/// key's identifier, which policies name.
pub fn add_key(mnt: BorrowedFd<'_>, key: &[u8; KEY_LEN]) -> SysResult<[u8; 16]> {
    let mut arg = AddKeyArg {
        spec_type: FSCRYPT_KEY_SPEC_TYPE_IDENTIFIER,
        spec_reserved: 0,
        identifier: [0; 16],
        spec_pad: [0; 16],
        raw_size: KEY_LEN as u32,
        key_id: 0,
        reserved: [0; 8],
        raw: *key,
    };
    // SAFETY: the ioctl reads the fixed part and `raw_size` bytes of `raw`, all inside `arg`, and
    // writes the identifier back into it; `arg` outlives the call.
    let ret = unsafe { libc::ioctl(mnt.as_raw_fd(), FS_IOC_ADD_ENCRYPTION_KEY, &mut arg as *mut AddKeyArg) };
    arg.raw = [0; KEY_LEN];
    check("ioctl(FS_IOC_ADD_ENCRYPTION_KEY)", ret as libc::c_long)?;
    Ok(arg.identifier)
}

/// Encrypt what is created below the empty directory `dir` with the key `identifier` names.
/// Setting the same policy again is a no-op; a directory encrypted with another key fails
/// with `EEXIST`, a filesystem without encryption with `EOPNOTSUPP`.
pub fn set_policy(dir: BorrowedFd<'_>, identifier: [u8; 16]) -> SysResult<()> {
    let policy = PolicyV2 {
        version: FSCRYPT_POLICY_V2,
        contents_mode: FSCRYPT_MODE_AES_256_XTS,
        filenames_mode: FSCRYPT_MODE_AES_256_CTS,
        flags: FSCRYPT_POLICY_FLAGS_PAD_32,
        reserved: [0; 4],
        identifier,
    };
    // SAFETY: the ioctl reads a whole v2 policy (its version byte says so) from `policy`, which
    // outlives the call.
    let ret = unsafe { libc::ioctl(dir.as_raw_fd(), FS_IOC_SET_ENCRYPTION_POLICY, &policy as *const PolicyV2) };
    check("ioctl(FS_IOC_SET_ENCRYPTION_POLICY)", ret as libc::c_long).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<AddKeyArg>() - KEY_LEN, 80);
        assert_eq!(std::mem::size_of::<PolicyV2>(), 24);
        // _IOC(dir, 'f', nr, size) = dir << 30 | size << 16 | 'f' << 8 | nr
        let ioc = |dir: u64, nr: u64, size: u64| (dir << 30 | size << 16 | (b'f' as u64) << 8 | nr) as libc::c_ulong;
        assert_eq!(FS_IOC_ADD_ENCRYPTION_KEY, ioc(3, 23, 80));
        assert_eq!(FS_IOC_SET_ENCRYPTION_POLICY, ioc(2, 19, 12));
    }
}
