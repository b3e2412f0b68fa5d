//! Building the base image with debootstrap.

use crate::fsutil::{random_hex, remove_tree, shift_tree, unmount_under, WorkDir};
use crate::store::{validate_name, Commit, ImageStore, Staged};
use crate::{io_err, now_secs, BaseImageOpts, Image, LayersError, Progress};
use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::fs;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Default environment of the base image.
pub const BASE_ENV: &[&str] = &["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"];

impl BaseImageOpts {
    fn validate(&self) -> Result<(), LayersError> {
        let suite_ok = !self.suite.is_empty()
            && self.suite.len() <= 64
            && self.suite.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && self.suite.as_bytes()[0].is_ascii_alphanumeric();
        if !suite_ok {
            return Err(LayersError::InvalidOption {
                field: "suite",
                value: self.suite.clone(),
                hint: "use a Debian suite name such as `bookworm`",
            });
        }
        let mirror_ok = ["http://", "https://", "file:///"].iter().any(|p| self.mirror.starts_with(p))
            && !self.mirror.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control());
        if !mirror_ok {
            return Err(LayersError::InvalidOption {
                field: "mirror",
                value: self.mirror.clone(),
                hint: "use an http://, https:// or file:/// URL of a Debian mirror, e.g. http://deb.debian.org/debian",
            });
        }
        for p in &self.packages {
            let ok = p.len() >= 2
                && p.len() <= 100
                && p.as_bytes()[0].is_ascii_alphanumeric()
                && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
            if !ok {
                return Err(LayersError::InvalidOption {
                    field: "package",
                    value: p.clone(),
                    hint: "Debian package names are lowercase letters, digits and + - . (at least 2 characters)",
                });
            }
        }
        Ok(())
    }
}

/// Turns debootstrap's `I:` lines into [`Progress`].
#[derive(Default)]
pub(crate) struct DebootstrapProgress {
    fetched: u64,
    unpacked: u64,
    configured: u64,
}

impl DebootstrapProgress {
    fn stage(stage: &str, message: &str) -> Progress {
        Progress::Stage { stage: stage.into(), message: message.trim_end_matches("...").trim().into() }
    }

    /// Progress for one output line (possibly none).
    pub fn line(&mut self, line: &str) -> Option<Progress> {
        let line = line.trim_end();
        if let Some(w) = line.strip_prefix("W: ") {
            return Some(Self::stage("warning", w));
        }
        if let Some(e) = line.strip_prefix("E: ") {
            return Some(Self::stage("error", e));
        }
        let rest = line.strip_prefix("I: ")?;
        let is_index =
            |r: &str| matches!(r.split_whitespace().next(), Some("InRelease" | "Release" | "Release.gpg" | "Packages"));
        if let Some(r) = rest.strip_prefix("Retrieving ") {
            let _ = r;
            return Some(Self::stage("download", rest));
        }
        if let Some(r) = rest.strip_prefix("Validating ") {
            if !is_index(r) {
                self.fetched += 1;
            }
            return Some(Self::stage("download", rest));
        }
        if rest.starts_with("Extracting ") {
            return Some(Self::stage("extract", rest));
        }
        let group = |r: &str| {
            r.starts_with("required packages") || r.starts_with("the base system") || r.starts_with("helper packages")
        };
        if let Some(r) = rest.strip_prefix("Unpacking ") {
            if group(r) {
                return Some(Self::stage("unpack", rest));
            }
            self.unpacked += 1;
            let total = self.fetched.max(self.unpacked);
            return Some(Progress::Step { stage: "unpack".into(), done: self.unpacked, total });
        }
        if let Some(r) = rest.strip_prefix("Configuring ") {
            if group(r) {
                return Some(Self::stage("configure", rest));
            }
            self.configured += 1;
            let total = self.fetched.max(self.configured);
            return Some(Progress::Step { stage: "configure".into(), done: self.configured, total });
        }
        if rest.starts_with("Base system installed successfully") {
            let total = self.fetched.max(self.configured);
            return Some(Progress::Step { stage: "configure".into(), done: total, total });
        }
        Some(Self::stage("debootstrap", rest))
    }
}

fn find_debootstrap() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].iter().map(PathBuf::from))
        .map(|d| d.join("debootstrap"))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Last `n` lines of a file (best effort).
fn tail_file(p: &Path, n: usize) -> Vec<String> {
    let Ok(mut f) = fs::File::open(p) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(16 << 10)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    let lines: Vec<String> = s.lines().map(str::to_string).collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// Replace `path` (whatever it is, symlinks not followed) with a new regular file.
fn write_new(path: &Path, content: &[u8], mode: u32) -> Result<(), LayersError> {
    remove_tree(path)?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err(format!("creating {}", path.display())))?;
    f.write_all(content).map_err(io_err(format!("writing {}", path.display())))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err(format!("chmod {}", path.display())))
}

/// Make `path` a directory with exactly `mode` (replacing a non-directory).
fn ensure_dir(path: &Path, mode: u32) -> Result<(), LayersError> {
    if !fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        remove_tree(path)?;
        fs::create_dir_all(path).map_err(io_err(format!("creating {}", path.display())))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err(format!("chmod {}", path.display())))
}

/// Remove the entries of `dir` selected by `pick` (missing `dir` is fine).
fn clean_dir(dir: &Path, pick: impl Fn(&str, &fs::Metadata) -> bool) -> Result<(), LayersError> {
    let Ok(rd) = fs::read_dir(dir) else { return Ok(()) };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Ok(m) = e.path().symlink_metadata() {
            if pick(&name, &m) {
                remove_tree(&e.path())?;
            }
        }
    }
    Ok(())
}

/// Strip what a sandbox must not carry (host-specific files, download caches, /dev nodes) and add
/// what it needs. Runs on the rootfs as written by debootstrap, before the ownership shift.
pub(crate) fn finalize_rootfs(root: &Path) -> Result<(), LayersError> {
    remove_tree(&root.join("debootstrap"))?;
    // Device nodes, /dev/pts, /dev/shm, /dev/fd symlinks: the sandbox gets a fresh /dev.
    clean_dir(&root.join("dev"), |_, _| true)?;
    clean_dir(&root.join("var/cache/apt/archives"), |n, m| n.ends_with(".deb") && !m.is_dir())?;
    clean_dir(&root.join("var/cache/apt/archives/partial"), |_, _| true)?;
    clean_dir(&root.join("var/lib/apt/lists/partial"), |_, _| true)?;
    clean_dir(&root.join("var/cache/apt"), |n, m| n.ends_with(".bin") && m.is_file())?;
    clean_dir(&root.join("var/lib/apt/lists"), |n, _| n != "lock" && n != "partial" && n != "auxfiles")?;
    clean_dir(&root.join("var/log"), |n, m| m.is_file() && (n.ends_with(".log") || n == "alternatives.log"))?;
    for d in ["proc", "sys", "run"] {
        clean_dir(&root.join(d), |_, _| true)?;
    }
    write_new(&root.join("etc/hostname"), b"sandbox\n", 0o644)?;
    write_new(
        &root.join("etc/hosts"),
        b"127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n",
        0o644,
    )?;
    // debootstrap copies the host's resolv.conf; the sandbox must not inherit it. An (empty)
    // file stays so the runtime can bind-mount or overwrite its own.
    write_new(&root.join("etc/resolv.conf"), b"", 0o644)?;
    add_user(root)?;
    profile_without_id_fork(root)?;
    hostname_resolves(root)?;
    locale_archive(root);
    for (d, mode) in [
        ("root", 0o700),
        ("tmp", 0o1777),
        ("var/tmp", 0o1777),
        ("dev", 0o755),
        ("proc", 0o555),
        ("sys", 0o555),
        ("run", 0o755),
    ] {
        ensure_dir(&root.join(d), mode)?;
    }
    Ok(())
}

/// Debian's /etc/profile asks `$(id -u)` whether it runs as root: a fork and an exec in every
/// login shell, which is how E2B's SDKs run each command (`bash -l -c`). Bash knows the answer
/// (`$EUID`); other shells still ask `id`.
const PROFILE_ROOT_TEST: &str = "\"$(id -u)\"";
const PROFILE_ROOT_TEST_FAST: &str = "\"${EUID:-$(id -u)}\"";

fn profile_without_id_fork(root: &Path) -> Result<(), LayersError> {
    let path = root.join("etc/profile");
    let Ok(text) = fs::read_to_string(&path) else { return Ok(()) };
    if !text.contains(PROFILE_ROOT_TEST) {
        return Ok(());
    }
    write_new(&path, text.replace(PROFILE_ROOT_TEST, PROFILE_ROOT_TEST_FAST).as_bytes(), 0o644)
}

/// Each sandbox's hostname is its id, which /etc/hosts cannot know when the image is built:
/// glibc's `myhostname` module (libnss-myhostname, in the base image's packages) answers for it,
/// so `sudo` does not warn "unable to resolve host" (or, with a network, wait on DNS for it) and
/// `hostname -f` works. Added to the `hosts` line of /etc/nsswitch.conf right after `files`
/// when the module is installed; an image without it, or whose line has it, is left alone.
fn hostname_resolves(root: &Path) -> Result<(), LayersError> {
    let has_module = ["usr/lib", "lib"].iter().any(|dir| {
        fs::read_dir(root.join(dir))
            .map(|entries| entries.flatten().any(|e| e.path().join("libnss_myhostname.so.2").exists()))
            .unwrap_or(false)
    });
    let path = root.join("etc/nsswitch.conf");
    let Ok(text) = fs::read_to_string(&path) else { return Ok(()) };
    if !has_module {
        return Ok(());
    }
    let mut changed = false;
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.first() != Some(&"hosts:") || words.contains(&"myhostname") {
                return line.to_string();
            }
            changed = true;
            let at = words.iter().position(|w| *w == "files").map_or(1, |i| i + 1);
            let mut out = words[..at].to_vec();
            out.push("myhostname");
            out.extend_from_slice(&words[at..]);
            format!("{:<16}{}", out[0], out[1..].join(" "))
        })
        .collect();
    if !changed {
        return Ok(());
    }
    write_new(&path, (lines.join("\n") + "\n").as_bytes(), 0o644)
}

/// Where glibc looks for compiled locales first, and Debian's C.UTF-8 (the sandboxes' `LANG`).
const LOCALE_ARCHIVE: &str = "usr/lib/locale/locale-archive";
const C_UTF8_DIR: &str = "usr/lib/locale/C.utf8";

/// Put C.UTF-8 into a locale archive. Debian ships it as a directory of a dozen files, which
/// glibc opens one by one in every process that calls `setlocale` (bash, python, coreutils):
/// ~60 syscalls per exec; from the archive it is one open and a map. Done with the image's own
/// `localedef` in a chroot of the image being built (trusted: just debootstrapped). An image
/// without `localedef` or C.UTF-8, or one that already has an archive, is left alone; a failure
/// only costs the speed-up, so it is logged, not fatal.
fn locale_archive(root: &Path) {
    if root.join(LOCALE_ARCHIVE).exists()
        || !root.join(C_UTF8_DIR).is_dir()
        || !root.join("usr/bin/localedef").is_file()
    {
        return;
    }
    let out = Command::new("chroot")
        .arg(root)
        .args(["/usr/bin/localedef", "--add-to-archive", &format!("/{C_UTF8_DIR}")])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => tracing::warn!(
            status = %o.status,
            stderr = %String::from_utf8_lossy(&o.stderr),
            "localedef --add-to-archive failed: the image's processes load C.UTF-8 file by file"
        ),
        Err(e) => tracing::warn!(error = %e, "could not run chroot for localedef: the image keeps C.UTF-8 as files"),
    }
}

/// The unprivileged account every image built here has (as E2B's base template): `user`, uid and
/// gid [`USER_ID`], home `/home/user` (a copy of /etc/skel), bash, and passwordless sudo when sudo
/// is installed. An image that already has it is left alone.
pub const USER_NAME: &str = "user";
pub const USER_ID: u32 = 1000;

fn add_user(root: &Path) -> Result<(), LayersError> {
    let passwd = root.join("etc/passwd");
    let have = fs::read_to_string(&passwd).unwrap_or_default();
    if have.lines().any(|l| l.split(':').next() == Some(USER_NAME)) {
        return Ok(());
    }
    let append = |rel: &str, line: String| -> Result<(), LayersError> {
        let path = root.join(rel);
        if !path.exists() {
            return Ok(());
        }
        let mut f = fs::OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        f.write_all(line.as_bytes()).map_err(io_err(format!("writing {}", path.display())))
    };
    let (name, id) = (USER_NAME, USER_ID);
    append("etc/passwd", format!("{name}:x:{id}:{id}::/home/{name}:/bin/bash\n"))?;
    append("etc/group", format!("{name}:x:{id}:\n"))?;
    append("etc/shadow", format!("{name}:*:19000:0:99999:7:::\n"))?;
    append("etc/gshadow", format!("{name}:!::\n"))?;
    let home = root.join("home").join(name);
    ensure_dir(&root.join("home"), 0o755)?;
    ensure_dir(&home, 0o750)?;
    if let Ok(rd) = fs::read_dir(root.join("etc/skel")) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                let to = home.join(e.file_name());
                fs::copy(e.path(), &to).map_err(io_err(format!("copying {}", to.display())))?;
                std::os::unix::fs::lchown(&to, Some(id), Some(id))
                    .map_err(io_err(format!("chown {}", to.display())))?;
            }
        }
    }
    std::os::unix::fs::lchown(&home, Some(id), Some(id)).map_err(io_err(format!("chown {}", home.display())))?;
    if root.join("etc/sudoers.d").is_dir() {
        write_new(
            &root.join("etc/sudoers.d").join(name),
            format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL\n").as_bytes(),
            0o440,
        )?;
    }
    Ok(())
}

impl ImageStore {
    /// Build image `name` with `debootstrap --variant=minbase` (see the crate docs). Replaces an
    /// existing image of that name only once the new one is complete.
    pub fn build_base(
        &self,
        name: &str,
        opts: &BaseImageOpts,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Image, LayersError> {
        validate_name(name)?;
        opts.validate()?;
        let debootstrap = find_debootstrap().ok_or(LayersError::DebootstrapMissing)?;
        let cache = self.cache_dir().join("debootstrap");
        fs::create_dir_all(&cache).map_err(io_err(format!("creating {}", cache.display())))?;
        // One debootstrap at a time per cache dir (concurrent runs would clobber its .debs).
        let lock_path = self.cache_dir().join("debootstrap.lock");
        let lock_file = fs::File::create(&lock_path).map_err(io_err(format!("creating {}", lock_path.display())))?;
        let _cache_lock = match Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((f, _)) => {
                progress(Progress::Stage {
                    stage: "prepare".into(),
                    message: "waiting for another base image build to finish".into(),
                });
                Flock::lock(f, FlockArg::LockExclusive)
                    .map_err(|(_, e)| LayersError::io(format!("locking {}", lock_path.display()), e.into()))?
            }
        };
        let work = WorkDir::new(&self.tmp_dir(), "build")?;
        let rootfs = work.path.join("rootfs");
        fs::create_dir(&rootfs).map_err(io_err(format!("creating {}", rootfs.display())))?;

        let mut cmd = Command::new(&debootstrap);
        cmd.arg("--variant=minbase");
        if !opts.packages.is_empty() {
            cmd.arg(format!("--include={}", opts.packages.join(",")));
        }
        cmd.arg(format!("--cache-dir={}", cache.display()))
            .arg(&opts.suite)
            .arg(&rootfs)
            .arg(&opts.mirror)
            .env("LC_ALL", "C")
            .env("DEBIAN_FRONTEND", "noninteractive")
            // dpkg's defaults plus unsafe-io: no fsync per unpacked file (the biggest cost of a
            // build). Durability comes from one syncfs() before the layer is committed.
            .env("DPKG_FORCE", "security-mac,downgrade,unsafe-io")
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        progress(Progress::Stage {
            stage: "prepare".into(),
            message: format!("debootstrap {} from {} with {}", opts.suite, opts.mirror, opts.packages.join(",")),
        });
        let started = std::time::Instant::now();
        let mut child = cmd.spawn().map_err(io_err(format!("starting {}", debootstrap.display())))?;

        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let mut readers = Vec::new();
        let streams: Vec<Box<dyn Read + Send>> = vec![
            Box::new(child.stdout.take().expect("piped stdout")),
            Box::new(child.stderr.take().expect("piped stderr")),
        ];
        for s in streams {
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(s).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            }));
        }
        drop(tx);
        let mut parser = DebootstrapProgress::default();
        let mut tail: VecDeque<String> = VecDeque::new();
        for line in rx {
            tracing::debug!(target: "debootstrap", "{line}");
            if tail.len() == 30 {
                tail.pop_front();
            }
            tail.push_back(line.clone());
            if let Some(p) = parser.line(&line) {
                progress(p);
            }
        }
        for r in readers {
            let _ = r.join();
        }
        let status = child.wait().map_err(io_err("waiting for debootstrap"))?;
        // debootstrap unmounts what it mounted on success, but not always on failure.
        unmount_under(&rootfs)?;
        if !status.success() {
            let mut output: Vec<String> = tail.into_iter().collect();
            let log = tail_file(&rootfs.join("debootstrap/debootstrap.log"), 20);
            if !log.is_empty() {
                output.push("--- debootstrap.log ---".into());
                output.extend(log);
            }
            return Err(LayersError::DebootstrapFailed { status: status.to_string(), output: output.join("\n") });
        }
        tracing::info!(secs = started.elapsed().as_secs_f64(), "debootstrap finished");

        progress(Progress::Stage { stage: "finalize".into(), message: "cleaning the root filesystem".into() });
        finalize_rootfs(&rootfs)?;
        progress(Progress::Stage {
            stage: "finalize".into(),
            message: format!("shifting ownership to host ids {}+", self.idmap().host_base),
        });
        let size = shift_tree(&rootfs, &self.idmap())?;
        let root_dir = fs::File::open(&rootfs).map_err(io_err(format!("opening {}", rootfs.display())))?;
        nix::unistd::syncfs(root_dir.as_raw_fd())
            .map_err(|e| LayersError::io(format!("syncing {}", rootfs.display()), e.into()))?;

        let layer_id = format!("local:{}", random_hex(16)?);
        let created_at = now_secs();
        let env: Vec<String> = BASE_ENV.iter().map(|s| s.to_string()).collect();
        let synthesized = serde_json::json!({
            "layers": [&layer_id], "env": env, "suite": opts.suite, "mirror": opts.mirror,
            "packages": opts.packages, "created_at": created_at,
        });
        let image = Image {
            name: name.to_string(),
            id: format!("sha256:{}", hex::encode(Sha256::digest(synthesized.to_string().as_bytes()))),
            layers: vec![layer_id.clone()],
            env,
            workdir: Some("/root".into()),
            cmd: vec!["/bin/bash".into()],
            size_bytes: size,
            created_at,
            source: "debootstrap".into(),
        };
        let staged = Staged { id: layer_id.clone(), root: rootfs, size, _work: work };
        match self.commit(image, vec![staged], progress)? {
            Commit::Done(img) => Ok(img),
            Commit::Missing(_) => {
                Err(LayersError::LayerMissing { image: name.to_string(), layer: layer_id, path: self.layers_dir() })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_from_debootstrap_lines() {
        let mut p = DebootstrapProgress::default();
        let stage = |s: &str, m: &str| Some(Progress::Stage { stage: s.into(), message: m.into() });
        assert_eq!(p.line("I: Retrieving InRelease "), stage("download", "Retrieving InRelease"));
        assert_eq!(p.line("I: Validating Packages "), stage("download", "Validating Packages"));
        assert_eq!(p.line("I: Retrieving bash 5.2.15-2+b13"), stage("download", "Retrieving bash 5.2.15-2+b13"));
        assert_eq!(p.line("I: Validating bash 5.2.15-2+b13"), stage("download", "Validating bash 5.2.15-2+b13"));
        assert_eq!(p.line("I: Validating dash 0.5.12-2"), stage("download", "Validating dash 0.5.12-2"));
        assert_eq!(p.line("I: Extracting bash..."), stage("extract", "Extracting bash"));
        assert_eq!(p.line("I: Unpacking required packages..."), stage("unpack", "Unpacking required packages"));
        assert_eq!(p.line("I: Unpacking bash..."), Some(Progress::Step { stage: "unpack".into(), done: 1, total: 2 }));
        assert_eq!(
            p.line("I: Configuring dash..."),
            Some(Progress::Step { stage: "configure".into(), done: 1, total: 2 })
        );
        assert_eq!(
            p.line("I: Configuring bash..."),
            Some(Progress::Step { stage: "configure".into(), done: 2, total: 2 })
        );
        // More packages than downloaded (e.g. all cached): total grows with done.
        assert_eq!(
            p.line("I: Configuring extra..."),
            Some(Progress::Step { stage: "configure".into(), done: 3, total: 3 })
        );
        assert_eq!(
            p.line("I: Base system installed successfully."),
            Some(Progress::Step { stage: "configure".into(), done: 3, total: 3 })
        );
        assert_eq!(p.line("W: Failure trying to run: chroot x"), stage("warning", "Failure trying to run: chroot x"));
        assert_eq!(p.line("dpkg: random noise"), None);
    }

    #[test]
    fn opts_validation() {
        let ok = BaseImageOpts::default();
        ok.validate().unwrap();
        let bad_pkg = BaseImageOpts { packages: vec!["python3,evil".into()], ..ok.clone() };
        assert!(matches!(bad_pkg.validate(), Err(LayersError::InvalidOption { field: "package", .. })));
        let bad_suite = BaseImageOpts { suite: "../x".into(), ..ok.clone() };
        assert!(matches!(bad_suite.validate(), Err(LayersError::InvalidOption { field: "suite", .. })));
        let bad_mirror = BaseImageOpts { mirror: "ftp://x y".into(), ..ok };
        assert!(matches!(bad_mirror.validate(), Err(LayersError::InvalidOption { field: "mirror", .. })));
    }

    #[test]
    fn finalize_cleans_host_leftovers() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        for p in
            ["dev/pts", "etc", "var/cache/apt/archives/partial", "var/lib/apt/lists/partial", "debootstrap", "proc/x"]
        {
            fs::create_dir_all(r.join(p)).unwrap();
        }
        fs::write(r.join("dev/null-ish"), b"").unwrap();
        fs::write(r.join("var/cache/apt/archives/bash_5.2_amd64.deb"), b"deb").unwrap();
        fs::write(r.join("var/cache/apt/archives/lock"), b"").unwrap();
        fs::write(r.join("var/cache/apt/pkgcache.bin"), b"").unwrap();
        fs::write(r.join("var/lib/apt/lists/deb.debian.org_InRelease"), b"").unwrap();
        // A host-pointing symlink must be replaced, not written through.
        std::os::unix::fs::symlink(d.path().join("outside"), r.join("etc/resolv.conf")).unwrap();
        finalize_rootfs(r).unwrap();
        assert_eq!(fs::read_dir(r.join("dev")).unwrap().count(), 0);
        assert!(!r.join("debootstrap").exists());
        assert!(!r.join("var/cache/apt/archives/bash_5.2_amd64.deb").exists());
        assert!(r.join("var/cache/apt/archives/lock").exists());
        assert!(!r.join("var/cache/apt/pkgcache.bin").exists());
        assert!(!r.join("var/lib/apt/lists/deb.debian.org_InRelease").exists());
        assert!(r.join("var/lib/apt/lists/partial").is_dir());
        assert!(!r.join("proc/x").exists());
        assert!(!d.path().join("outside").exists());
        assert!(fs::symlink_metadata(r.join("etc/resolv.conf")).unwrap().is_file());
        assert_eq!(fs::read_to_string(r.join("etc/hostname")).unwrap(), "sandbox\n");
        let mode = |p: &str| fs::metadata(r.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode("tmp"), 0o1777);
        assert_eq!(mode("var/tmp"), 0o1777);
        assert_eq!(mode("root"), 0o700);
    }

    /// Debian bookworm's /etc/profile, as debootstrap writes it.
    const DEBIAN_PROFILE: &str = r#"# /etc/profile: system-wide .profile file for the Bourne shell (sh(1))
if [ "$(id -u)" -eq 0 ]; then
  PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH
"#;

    #[test]
    fn a_root_without_localedef_or_c_utf8_is_left_as_it_is() {
        let d = tempfile::tempdir().unwrap();
        locale_archive(d.path()); // no C.UTF-8: nothing to do
        fs::create_dir_all(d.path().join(C_UTF8_DIR)).unwrap();
        locale_archive(d.path()); // no localedef: nothing to run
        assert!(!d.path().join(LOCALE_ARCHIVE).exists());
        fs::create_dir_all(d.path().join("usr/bin")).unwrap();
        fs::write(d.path().join("usr/bin/localedef"), b"#!/nonexistent\n").unwrap();
        fs::write(d.path().join(LOCALE_ARCHIVE), b"kept").unwrap();
        locale_archive(d.path()); // an archive already there: kept as it is
        assert_eq!(fs::read(d.path().join(LOCALE_ARCHIVE)).unwrap(), b"kept");
    }

    #[test]
    fn the_hostname_resolves_through_myhostname_when_the_image_has_it() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        fs::create_dir_all(r.join("etc")).unwrap();
        let conf = "passwd:         files\nhosts:          files dns\nnetworks:       files\n";
        fs::write(r.join("etc/nsswitch.conf"), conf).unwrap();
        hostname_resolves(r).unwrap(); // no module: left alone
        assert_eq!(fs::read_to_string(r.join("etc/nsswitch.conf")).unwrap(), conf);
        fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        fs::write(r.join("usr/lib/x86_64-linux-gnu/libnss_myhostname.so.2"), b"").unwrap();
        hostname_resolves(r).unwrap();
        let want = "passwd:         files\nhosts:          files myhostname dns\nnetworks:       files\n";
        assert_eq!(fs::read_to_string(r.join("etc/nsswitch.conf")).unwrap(), want);
        hostname_resolves(r).unwrap(); // idempotent
        assert_eq!(fs::read_to_string(r.join("etc/nsswitch.conf")).unwrap(), want);
        // A line without `files`: myhostname comes first.
        fs::write(r.join("etc/nsswitch.conf"), "hosts: dns\n").unwrap();
        hostname_resolves(r).unwrap();
        assert_eq!(fs::read_to_string(r.join("etc/nsswitch.conf")).unwrap(), "hosts:          myhostname dns\n");
    }

    #[test]
    fn the_profile_asks_bash_not_id_and_still_tells_root_apart() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("etc")).unwrap();
        let profile = d.path().join("etc/profile");
        fs::write(&profile, DEBIAN_PROFILE).unwrap();
        profile_without_id_fork(d.path()).unwrap();
        let text = fs::read_to_string(&profile).unwrap();
        assert!(text.contains("if [ \"${EUID:-$(id -u)}\" -eq 0 ]; then") && !text.contains("\"$(id -u)\""), "{text}");
        profile_without_id_fork(d.path()).unwrap(); // idempotent
        assert_eq!(fs::read_to_string(&profile).unwrap(), text);
        // Both shells still pick the PATH of who runs them (bash by $EUID, sh by id).
        let root = nix::unistd::geteuid().is_root();
        for shell in ["bash", "sh"] {
            let out = std::process::Command::new(shell)
                .arg("-c")
                .arg(format!(". {}; echo \"$PATH\"", profile.display()))
                .output()
                .unwrap();
            assert!(out.status.success(), "{shell}: {out:?}");
            let path = String::from_utf8(out.stdout).unwrap();
            assert_eq!(path.starts_with("/usr/local/sbin:"), root, "{shell}: {path}");
        }
    }

    /// Needs root (chown to the user's ids).
    #[test]
    fn images_get_an_unprivileged_user_with_sudo_once() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        for p in ["etc/skel", "etc/sudoers.d"] {
            fs::create_dir_all(r.join(p)).unwrap();
        }
        fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        fs::write(r.join("etc/group"), "root:x:0:\n").unwrap();
        fs::write(r.join("etc/skel/.bashrc"), "# rc\n").unwrap();
        add_user(r).unwrap();
        add_user(r).unwrap();
        let passwd = fs::read_to_string(r.join("etc/passwd")).unwrap();
        assert_eq!(passwd.matches("user:x:1000:1000::/home/user:/bin/bash").count(), 1, "{passwd}");
        assert!(fs::read_to_string(r.join("etc/group")).unwrap().contains("user:x:1000:"));
        let sudo = fs::read_to_string(r.join("etc/sudoers.d/user")).unwrap();
        assert_eq!(sudo, "user ALL=(ALL:ALL) NOPASSWD: ALL\n");
        let home = fs::metadata(r.join("home/user")).unwrap();
        assert_eq!((home.uid(), home.gid()), (1000, 1000));
        assert_eq!(fs::metadata(r.join("home/user/.bashrc")).unwrap().uid(), 1000);
    }
}
