//! Test helpers: root check, auto-unmount, and writers for synthetic layer tars, `docker save`
//! tarballs and OCI image layouts.
#![allow(dead_code)]

use serde_json::json;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests need root (chown to shifted ids, whiteout mknod, trusted.* xattrs, mounts); run them as root"
    );
}

/// Unmounts on drop (also when a test fails midway).
pub struct Mounted(pub PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = bb_layers::unmount(&self.0);
    }
}

/// Mount `image` on a fresh overlay under `dir` and return the mount guard.
pub fn mount_image(store: &bb_layers::ImageStore, img: &bb_layers::Image, dir: &Path) -> Mounted {
    let (upper, work) = bb_layers::new_writable(&dir.join("rw"), &store.idmap()).unwrap();
    let merged = dir.join("merged");
    fs::create_dir_all(&merged).unwrap();
    let lower = store.lower_dirs(img);
    let t = std::time::Instant::now();
    bb_layers::mount_overlay(&bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work }, &merged).unwrap();
    eprintln!("overlay mount of {} layers: {:?}", lower.len(), t.elapsed());
    Mounted(merged)
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

pub const MTIME: u64 = 1_700_000_000;

/// An uncompressed layer tar.
pub struct LayerTar(tar::Builder<Vec<u8>>);

impl Default for LayerTar {
    fn default() -> Self {
        Self::new()
    }
}

impl LayerTar {
    pub fn new() -> Self {
        LayerTar(tar::Builder::new(Vec::new()))
    }
    pub fn entry(
        mut self,
        path: &str,
        kind: tar::EntryType,
        mode: u32,
        uid: u64,
        data: &[u8],
        link: Option<&str>,
    ) -> Self {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        if let Some(l) = link {
            h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
        }
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_size(data.len() as u64);
        h.set_mtime(MTIME);
        h.set_cksum();
        self.0.append(&h, data).unwrap();
        self
    }
    pub fn dir(self, p: &str) -> Self {
        self.entry(p, tar::EntryType::Directory, 0o755, 0, b"", None)
    }
    pub fn file(self, p: &str, data: &str) -> Self {
        self.entry(p, tar::EntryType::Regular, 0o644, 0, data.as_bytes(), None)
    }
    pub fn file_owned(self, p: &str, data: &str, mode: u32, uid: u64) -> Self {
        self.entry(p, tar::EntryType::Regular, mode, uid, data.as_bytes(), None)
    }
    pub fn symlink(self, p: &str, target: &str) -> Self {
        self.entry(p, tar::EntryType::Symlink, 0o777, 0, b"", Some(target))
    }
    pub fn hardlink(self, p: &str, target: &str) -> Self {
        self.entry(p, tar::EntryType::Link, 0o644, 0, b"", Some(target))
    }
    /// `.wh.<name>` in `dir` ("" = root).
    pub fn whiteout(self, dir: &str, name: &str) -> Self {
        let p = if dir.is_empty() { format!(".wh.{name}") } else { format!("{dir}/.wh.{name}") };
        self.file(&p, "")
    }
    pub fn opaque(self, dir: &str) -> Self {
        self.file(&format!("{dir}/.wh..wh..opq"), "")
    }
    pub fn chardev(self, p: &str) -> Self {
        self.entry(p, tar::EntryType::Char, 0o666, 0, b"", None)
    }
    pub fn build(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Comp {
    None,
    Gzip,
    Zstd,
}

pub fn compress(data: &[u8], c: Comp) -> Vec<u8> {
    match c {
        Comp::None => data.to_vec(),
        Comp::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(data).unwrap();
            e.finish().unwrap()
        }
        Comp::Zstd => zstd::encode_all(data, 1).unwrap(),
    }
}

/// A synthetic image: uncompressed layer tars (bottom first) and config fields.
pub struct TestImage {
    pub layers: Vec<Vec<u8>>,
    pub env: Vec<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub workdir: String,
}

impl TestImage {
    pub fn new(layers: Vec<Vec<u8>>) -> Self {
        TestImage {
            layers,
            env: vec!["PATH=/usr/bin:/bin".into(), "GREETING=hello world".into()],
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["echo hi".into()],
            workdir: "/work".into(),
        }
    }
    pub fn diff_ids(&self) -> Vec<String> {
        self.layers.iter().map(|l| format!("sha256:{}", sha256_hex(l))).collect()
    }
    pub fn config(&self, arch: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "architecture": arch, "os": "linux",
            "config": { "Env": self.env, "Entrypoint": self.entrypoint, "Cmd": self.cmd, "WorkingDir": self.workdir },
            "rootfs": { "type": "layers", "diff_ids": self.diff_ids() },
        }))
        .unwrap()
    }
    /// `sha256:` of the config blob: the image id `import` must report.
    pub fn id(&self) -> String {
        format!("sha256:{}", sha256_hex(&self.config(host_arch())))
    }
}

pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        a => a,
    }
}

fn tar_add(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
    let mut h = tar::Header::new_ustar();
    h.set_path(path).unwrap();
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_mtime(MTIME);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    b.append(&h, data).unwrap();
}

/// A legacy `docker save` tarball: manifest.json, `<id>.json`, `<n>/layer.tar` (compressed as
/// given per layer; the last layer is stored twice via a symlink, like docker does for repeats).
pub fn write_docker_save(path: &Path, img: &TestImage, comps: &[Comp]) {
    let mut b = tar::Builder::new(Vec::new());
    let config = img.config(host_arch());
    let config_name = format!("{}.json", sha256_hex(&config));
    let mut layer_paths = Vec::new();
    let last = img.layers.len().saturating_sub(1);
    for (i, l) in img.layers.iter().enumerate() {
        let dir = format!("{:064x}", i + 1);
        let p = format!("{dir}/layer.tar");
        let data = compress(l, comps.get(i).copied().unwrap_or(Comp::None));
        if i == last {
            // Stored elsewhere, reached through a relative symlink.
            tar_add(&mut b, "real-last/layer.tar", &data);
            let mut h = tar::Header::new_ustar();
            h.set_path(&p).unwrap();
            h.set_link_name("../real-last/layer.tar").unwrap();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_mode(0o777);
            h.set_size(0);
            h.set_mtime(MTIME);
            h.set_cksum();
            b.append(&h, std::io::empty()).unwrap();
        } else {
            tar_add(&mut b, &p, &data);
        }
        tar_add(&mut b, &format!("{dir}/VERSION"), b"1.0");
        layer_paths.push(p);
    }
    tar_add(&mut b, &config_name, &config);
    let manifest = json!([{ "Config": config_name, "RepoTags": ["test:latest"], "Layers": layer_paths }]);
    tar_add(&mut b, "manifest.json", &serde_json::to_vec(&manifest).unwrap());
    fs::write(path, b.into_inner().unwrap()).unwrap();
}

fn put_blob(dir: &Path, data: &[u8]) -> (String, u64) {
    let h = sha256_hex(data);
    let p = dir.join("blobs/sha256").join(&h);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, data).unwrap();
    (format!("sha256:{h}"), data.len() as u64)
}

/// An OCI image layout directory. With `multiarch`, index.json points to a nested image index
/// holding a decoy manifest for another architecture (whose blobs do not exist), the host's
/// manifest and an attestation manifest.
pub fn write_oci_layout(dir: &Path, img: &TestImage, comps: &[Comp], multiarch: bool) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let (cfg_digest, cfg_size) = put_blob(dir, &img.config(host_arch()));
    let mut layers = Vec::new();
    for (i, l) in img.layers.iter().enumerate() {
        let c = comps.get(i).copied().unwrap_or(Comp::None);
        let mt = match c {
            Comp::None => "application/vnd.oci.image.layer.v1.tar",
            Comp::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Comp::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        };
        let (d, s) = put_blob(dir, &compress(l, c));
        layers.push(json!({"mediaType": mt, "digest": d, "size": s}));
    }
    let manifest = json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_size},
        "layers": layers,
    });
    let (m_digest, m_size) = put_blob(dir, &serde_json::to_vec(&manifest).unwrap());
    let index = if multiarch {
        let other = if host_arch() == "arm64" { "amd64" } else { "arm64" };
        let decoy = json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", "e".repeat(64)), "size": 1},
            "layers": [],
        });
        let (dd, ds) = put_blob(dir, &serde_json::to_vec(&decoy).unwrap());
        let nested = json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": dd, "size": ds,
                 "platform": {"architecture": other, "os": "linux"}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest, "size": m_size,
                 "platform": {"architecture": host_arch(), "os": "linux"}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": dd, "size": ds,
                 "platform": {"architecture": "unknown", "os": "unknown"},
                 "annotations": {"vnd.docker.reference.type": "attestation-manifest"}},
            ],
        });
        let (nd, ns) = put_blob(dir, &serde_json::to_vec(&nested).unwrap());
        json!({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": nd, "size": ns,
             "annotations": {"org.opencontainers.image.ref.name": "latest"}}]})
    } else {
        json!({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest, "size": m_size,
             "annotations": {"org.opencontainers.image.ref.name": "latest"}}]})
    };
    fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

/// Pack a directory into a tar file (for OCI archives).
pub fn tar_dir(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
}

/// Names of the layer dirs in a state dir.
pub fn stored_layers(state: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(state.join("layers")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

/// Entries of `<state>/tmp` (work dirs must be gone after every operation).
pub fn tmp_entries(state: &Path) -> Vec<String> {
    fs::read_dir(state.join("tmp")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
}
