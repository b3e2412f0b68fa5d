//! Secret files: `len` random bytes made once (mode 0600), then read back by every start.

use std::io::{Read, Write};
use std::path::Path;

/// The secret in `path`, made with `len` bytes from the kernel's CSPRNG when missing. Two
/// processes making it at once both end up with the first file written (it is linked into
/// place, never renamed over). Errors: a file of another length, or one others may read.
pub fn load_or_create(path: &Path, len: usize) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::read(path) {
        Ok(bytes) => {
            if bytes.len() != len {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("holds {} bytes, not {len}", bytes.len()),
                ));
            }
            let mode = std::fs::metadata(path)?.permissions().mode();
            if mode & 0o077 != 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("mode {:o} lets others read it: chmod 600 it", mode & 0o777),
                ));
            }
            Ok(bytes)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut secret = vec![0u8; len];
            std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
            let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            let written = f.write_all(&secret).and_then(|()| f.sync_all());
            let linked = written.and_then(|()| match std::fs::hard_link(&tmp, path) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
                other => other,
            });
            let _ = std::fs::remove_file(&tmp);
            linked?;
            load_or_create(path, len)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_secret_is_made_private_once_and_refused_when_readable_or_of_another_length() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        let a = load_or_create(&p, 32).unwrap();
        assert_eq!(a.len(), 32);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(load_or_create(&p, 32).unwrap(), a);
        assert!(load_or_create(&p, 16).unwrap_err().to_string().contains("32 bytes, not 16"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_or_create(&p, 32).unwrap_err().to_string().contains("chmod 600"));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temporary file left");
    }
}
