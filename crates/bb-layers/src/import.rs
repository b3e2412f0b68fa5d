//! Importing `docker save` tarballs and OCI image layouts (directory or tar).

use crate::extract::{normalize_entry_path, LayerWriter};
use crate::fsutil::WorkDir;
use crate::store::{validate_name, Commit, ImageStore, Staged};
use crate::{io_err, now_secs, Image, LayersError, Progress};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const MAX_JSON: u64 = 16 << 20;
const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// Where a file of the outer archive lives.
enum Loc {
    File { offset: u64, size: u64 },
    Link(String),
}

/// The image source: a directory, or an (uncompressed, possibly decompressed-to-tmp) tar file
/// whose regular files are read in place by offset.
enum Source {
    Dir(PathBuf),
    Tar { file: PathBuf, index: HashMap<String, Loc>, _tmp: Option<WorkDir> },
}

/// Normalize a path inside the image source (`./a/b` -> `a/b`); `None` if absolute or escaping.
fn norm(p: &Path) -> Option<String> {
    let n = normalize_entry_path(p).ok()?;
    let s = n.to_str()?.to_string();
    (!s.is_empty()).then_some(s)
}

#[derive(PartialEq, Debug)]
enum Compression {
    None,
    Gzip,
    Zstd,
    Other(&'static str),
}

fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Compression::Other("xz")
    } else if head.starts_with(b"BZh") {
        Compression::Other("bzip2")
    } else {
        Compression::None
    }
}

fn decompressor<'a>(r: BufReader<Box<dyn Read + 'a>>) -> io::Result<(Box<dyn Read + 'a>, Compression)> {
    let mut r = r;
    let c = sniff(r.fill_buf()?);
    Ok(match c {
        Compression::Gzip => (Box::new(flate2::read::MultiGzDecoder::new(r)), c),
        Compression::Zstd => (Box::new(zstd::stream::read::Decoder::with_buffer(r)?), c),
        _ => (Box::new(r), c),
    })
}

fn is_ustar(head: &[u8]) -> bool {
    head.len() >= 262 && &head[257..262] == b"ustar"
}

impl Source {
    fn open(path: &Path, tmp_root: &Path) -> Result<Source, LayersError> {
        let unsupported =
            |reason: &str| LayersError::UnsupportedSource { path: path.to_path_buf(), reason: reason.to_string() };
        let meta = fs::metadata(path).map_err(|e| unsupported(&format!("cannot read it ({e})")))?;
        if meta.is_dir() {
            return Ok(Source::Dir(path.to_path_buf()));
        }
        let mut head = [0u8; 512];
        let n = read_up_to(&mut File::open(path).map_err(io_err(format!("opening {}", path.display())))?, &mut head)
            .map_err(io_err(format!("reading {}", path.display())))?;
        let (file, tmp) = match sniff(&head[..n]) {
            Compression::None if is_ustar(&head[..n]) => (path.to_path_buf(), None),
            Compression::None => return Err(unsupported("it is neither a directory nor a tar archive")),
            Compression::Other(kind) => {
                return Err(unsupported(&format!("it is {kind}-compressed; decompress it first")))
            }
            Compression::Gzip | Compression::Zstd => {
                // `docker save | gzip`: decompress once into the store's tmp dir.
                let work = WorkDir::new(tmp_root, "import")?;
                let out = work.path.join("outer.tar");
                let f = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
                let (mut dec, _) = decompressor(BufReader::new(Box::new(f) as Box<dyn Read>))
                    .map_err(io_err(format!("reading {}", path.display())))?;
                let mut w = File::create(&out).map_err(io_err(format!("creating {}", out.display())))?;
                io::copy(&mut dec, &mut w).map_err(io_err(format!("decompressing {}", path.display())))?;
                (out, Some(work))
            }
        };
        let index = index_tar(&file).map_err(|e| unsupported(&format!("reading it as tar failed ({e})")))?;
        Ok(Source::Tar { file, index, _tmp: tmp })
    }

    fn exists(&self, rel: &str) -> bool {
        match self {
            Source::Dir(d) => norm(Path::new(rel)).is_some_and(|r| d.join(r).is_file()),
            Source::Tar { index, .. } => index.contains_key(rel),
        }
    }

    /// Open a file of the source by its path inside it. `None` if it does not exist.
    fn open_file(&self, rel: &str) -> io::Result<Option<Box<dyn Read + '_>>> {
        let Some(rel) = norm(Path::new(rel)) else {
            return Ok(None);
        };
        match self {
            Source::Dir(d) => match File::open(d.join(&rel)) {
                Ok(f) => Ok(Some(Box::new(f))),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            },
            Source::Tar { file, index, .. } => {
                let mut cur = rel;
                for _ in 0..16 {
                    match index.get(&cur) {
                        None => return Ok(None),
                        Some(Loc::Link(t)) => cur = t.clone(),
                        Some(Loc::File { offset, size }) => {
                            let mut f = File::open(file)?;
                            f.seek(SeekFrom::Start(*offset))?;
                            return Ok(Some(Box::new(f.take(*size))));
                        }
                    }
                }
                Ok(None)
            }
        }
    }
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn index_tar(path: &Path) -> io::Result<HashMap<String, Loc>> {
    let mut ar = tar::Archive::new(File::open(path)?);
    let mut index = HashMap::new();
    for e in ar.entries_with_seek()? {
        let e = e?;
        let p = e.path()?.into_owned();
        let Some(key) = norm(&p) else { continue };
        let t = e.header().entry_type();
        if t.is_file() || t.is_contiguous() {
            index.insert(key, Loc::File { offset: e.raw_file_position(), size: e.size() });
        } else if t.is_symlink() || t.is_hard_link() {
            let Some(target) = e.link_name()? else { continue };
            let full =
                if t.is_symlink() { p.parent().unwrap_or(Path::new("")).join(&target) } else { target.into_owned() };
            if let Some(tkey) = norm(&full) {
                index.insert(key, Loc::Link(tkey));
            }
        }
    }
    Ok(index)
}

#[derive(Deserialize)]
struct DockerManifestEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize, Debug, Clone)]
pub(crate) struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: Option<HashMap<String, String>>,
}

#[derive(Deserialize, Debug, Clone)]
pub(crate) struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

#[derive(Deserialize)]
struct OciIndex {
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct OciManifest {
    config: Descriptor,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(Deserialize, Default)]
struct ContainerConfig {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
}

#[derive(Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

#[derive(Deserialize)]
struct ImageConfig {
    #[serde(default)]
    config: Option<ContainerConfig>,
    rootfs: RootFs,
}

/// What an image source describes, before any layer is unpacked.
struct Parsed {
    id: String,
    /// (diff_id, path of the layer blob inside the source), bottom first.
    layers: Vec<(String, String)>,
    config: ContainerConfig,
    format: &'static str,
}

/// The OCI architecture name of this host.
pub(crate) fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        other => other,
    }
}

#[derive(Debug, PartialEq)]
pub(crate) enum SelectError {
    Empty,
    NoMatch(String),
    Ambiguous(String),
}

fn describe(d: &Descriptor) -> String {
    match &d.platform {
        Some(p) => {
            format!("{}/{}{}", p.os, p.architecture, p.variant.as_ref().map(|v| format!("/{v}")).unwrap_or_default())
        }
        None => d
            .annotations
            .as_ref()
            .and_then(|a| a.get("org.opencontainers.image.ref.name").or_else(|| a.get("io.containerd.image.name")))
            .cloned()
            .unwrap_or_else(|| d.digest.clone()),
    }
}

fn is_attestation(d: &Descriptor) -> bool {
    let kind = d.annotations.as_ref().and_then(|a| a.get("vnd.docker.reference.type"));
    kind.is_some_and(|t| t == "attestation-manifest")
}

/// Pick the manifest for this host from an index: attestation and `unknown/unknown` entries are
/// ignored; entries with a platform must be linux/`arch`; without platforms there must be one.
pub(crate) fn select_descriptor<'a>(descs: &'a [Descriptor], arch: &str) -> Result<&'a Descriptor, SelectError> {
    let candidates: Vec<&Descriptor> = descs
        .iter()
        .filter(|d| !is_attestation(d))
        .filter(|d| !d.platform.as_ref().is_some_and(|p| p.os == "unknown" || p.architecture == "unknown"))
        .collect();
    if candidates.is_empty() {
        return Err(SelectError::Empty);
    }
    if candidates.iter().any(|d| d.platform.is_some()) {
        return candidates
            .iter()
            .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == arch))
            .copied()
            .ok_or_else(|| {
                SelectError::NoMatch(candidates.iter().map(|d| describe(d)).collect::<Vec<_>>().join(", "))
            });
    }
    match candidates.as_slice() {
        [one] => Ok(one),
        many => Err(SelectError::Ambiguous(many.iter().map(|d| describe(d)).collect::<Vec<_>>().join(", "))),
    }
}

fn valid_digest(d: &str) -> Option<&str> {
    let h = d.strip_prefix("sha256:")?;
    (h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))).then_some(h)
}

/// Keep only the top-most occurrence of a layer that appears twice: the upper copy re-asserts
/// every path the lower one has, so the merged view is the same, and overlay refuses to stack
/// one directory twice.
pub(crate) fn dedupe_layers(layers: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<(String, String)> = layers.into_iter().rev().filter(|(id, _)| seen.insert(id.clone())).collect();
    out.reverse();
    out
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

impl ImageStore {
    /// Import a `docker save` tarball or an OCI image layout (directory or tar, optionally
    /// gzip/zstd-compressed as a whole) as image `name`, replacing an existing image of that name
    /// once the new one is complete. Layers already stored (same diff_id) are shared, not
    /// unpacked again.
    pub fn import(&self, name: &str, source: &Path, progress: &mut dyn FnMut(Progress)) -> Result<Image, LayersError> {
        validate_name(name)?;
        progress(Progress::Stage { stage: "read".into(), message: format!("reading {}", source.display()) });
        let src = Source::open(source, &self.tmp_dir())?;
        let parsed = parse(&src, source)?;
        progress(Progress::Stage {
            stage: "read".into(),
            message: format!("{} image {} with {} layers", parsed.format, parsed.id, parsed.layers.len()),
        });
        let layers = dedupe_layers(parsed.layers);
        let cfg = parsed.config;
        let mut cmd = cfg.entrypoint.unwrap_or_default();
        cmd.extend(cfg.cmd.unwrap_or_default());
        let image = Image {
            name: name.to_string(),
            id: parsed.id,
            layers: layers.iter().map(|(id, _)| id.clone()).collect(),
            env: cfg.env.unwrap_or_default(),
            workdir: cfg.working_dir.filter(|w| !w.is_empty()),
            cmd,
            size_bytes: 0,
            created_at: now_secs(),
            source: "oci".into(),
        };
        let total = layers.len() as u64;
        for _attempt in 0..3 {
            let mut staged = Vec::new();
            for (i, (diff_id, blob)) in layers.iter().enumerate() {
                progress(Progress::Step { stage: "extract".into(), done: i as u64, total });
                if self.layer_path(diff_id).is_dir() {
                    progress(Progress::Stage {
                        stage: "extract".into(),
                        message: format!("layer {diff_id} already stored, sharing it"),
                    });
                    continue;
                }
                progress(Progress::Stage { stage: "extract".into(), message: format!("unpacking layer {diff_id}") });
                staged.push(self.unpack_layer(&src, source, diff_id, blob)?);
            }
            progress(Progress::Step { stage: "extract".into(), done: total, total });
            match self.commit(image.clone(), staged, progress)? {
                Commit::Done(img) => return Ok(img),
                Commit::Missing(m) => tracing::info!(layers = ?m, "layers removed concurrently; unpacking them again"),
            }
        }
        Err(LayersError::LayerMissing {
            image: name.to_string(),
            layer: image.layers.join(", "),
            path: self.layers_dir(),
        })
    }

    fn unpack_layer(&self, src: &Source, source: &Path, diff_id: &str, blob: &str) -> Result<Staged, LayersError> {
        let work = WorkDir::new(&self.tmp_dir(), "layer")?;
        let root = work.path.join("root");
        fs::create_dir(&root).map_err(io_err(format!("creating {}", root.display())))?;
        let bad = |reason: String| LayersError::BadImage { path: source.to_path_buf(), reason };
        let reader = src
            .open_file(blob)
            .map_err(io_err(format!("reading layer {blob} of {}", source.display())))?
            .ok_or_else(|| bad(format!("layer file `{blob}` is missing")))?;
        let (dec, comp) = decompressor(BufReader::with_capacity(256 << 10, reader))
            .map_err(io_err(format!("reading layer {blob}")))?;
        if let Compression::Other(kind) = comp {
            return Err(bad(format!(
                "layer `{blob}` is {kind}-compressed; only uncompressed, gzip and zstd layers are supported"
            )));
        }
        let mut hashing = HashingReader { inner: dec, hasher: Sha256::new() };
        let mut writer = LayerWriter::new(&root, self.idmap(), diff_id)?;
        {
            let mut ar = tar::Archive::new(&mut hashing);
            writer.unpack(&mut ar)?;
        }
        // The tar reader stops at the end-of-archive marker; hash the padding after it too.
        io::copy(&mut hashing, &mut io::sink()).map_err(io_err(format!("reading layer {blob}")))?;
        let actual = format!("sha256:{}", hex::encode(hashing.hasher.finalize()));
        if actual != diff_id {
            return Err(LayersError::DigestMismatch { layer: blob.to_string(), expected: diff_id.to_string(), actual });
        }
        // Committed layers must be complete on disk even if the host crashes right after.
        let dir = File::open(&root).map_err(io_err(format!("opening {}", root.display())))?;
        nix::unistd::syncfs(dir.as_raw_fd())
            .map_err(|e| LayersError::io(format!("syncing {}", root.display()), e.into()))?;
        Ok(Staged { id: diff_id.to_string(), root, size: writer.size, _work: work })
    }
}

fn read_json_bytes(src: &Source, source: &Path, rel: &str) -> Result<Vec<u8>, LayersError> {
    let r = src
        .open_file(rel)
        .map_err(io_err(format!("reading {rel} in {}", source.display())))?
        .ok_or_else(|| LayersError::BadImage { path: source.to_path_buf(), reason: format!("`{rel}` is missing") })?;
    let mut buf = Vec::new();
    r.take(MAX_JSON).read_to_end(&mut buf).map_err(io_err(format!("reading {rel} in {}", source.display())))?;
    Ok(buf)
}

fn parse_json<T: for<'de> Deserialize<'de>>(bytes: &[u8], source: &Path, what: &str) -> Result<T, LayersError> {
    serde_json::from_slice(bytes)
        .map_err(|e| LayersError::BadImage { path: source.to_path_buf(), reason: format!("{what} is not valid: {e}") })
}

/// Read a blob of an OCI layout by digest, checking the digest.
fn read_blob(src: &Source, source: &Path, digest: &str) -> Result<Vec<u8>, LayersError> {
    let bad = |reason: String| LayersError::BadImage { path: source.to_path_buf(), reason };
    let hex_part =
        valid_digest(digest).ok_or_else(|| bad(format!("unsupported digest `{digest}` (only sha256 is supported)")))?;
    let bytes = read_json_bytes(src, source, &format!("blobs/sha256/{hex_part}"))?;
    if hex::encode(Sha256::digest(&bytes)) != hex_part {
        return Err(bad(format!("blob {digest} does not match its digest")));
    }
    Ok(bytes)
}

fn parse(src: &Source, source: &Path) -> Result<Parsed, LayersError> {
    let bad = |reason: String| LayersError::BadImage { path: source.to_path_buf(), reason };
    let (config_bytes, blobs, format) = if src.exists("manifest.json") {
        let entries: Vec<DockerManifestEntry> =
            parse_json(&read_json_bytes(src, source, "manifest.json")?, source, "manifest.json")?;
        let entry = match entries.as_slice() {
            [one] => one,
            [] => return Err(bad("manifest.json lists no image".into())),
            many => {
                let tags: Vec<String> =
                    many.iter().map(|e| e.repo_tags.clone().unwrap_or_default().join(" ")).collect();
                return Err(bad(format!(
                    "it holds {} images ({}); save a single image with `docker save -o image.tar IMAGE`",
                    many.len(),
                    tags.join(", ")
                )));
            }
        };
        (read_json_bytes(src, source, &entry.config)?, entry.layers.clone(), "docker-save")
    } else if src.exists("index.json") {
        let mut index: OciIndex = parse_json(&read_json_bytes(src, source, "index.json")?, source, "index.json")?;
        let manifest_bytes = 'resolve: {
            for _depth in 0..4 {
                let d = select_descriptor(&index.manifests, host_arch()).map_err(|e| match e {
                    SelectError::Empty => bad("the image index lists no image manifest".into()),
                    SelectError::NoMatch(available) => LayersError::NoMatchingPlatform {
                        path: source.to_path_buf(),
                        arch: host_arch().into(),
                        available,
                    },
                    SelectError::Ambiguous(list) => {
                        bad(format!("the index lists several images ({list}); export a single image"))
                    }
                })?;
                let bytes = read_blob(src, source, &d.digest)?;
                let is_index = d.media_type == MT_OCI_INDEX
                    || d.media_type == MT_DOCKER_LIST
                    || (d.media_type.is_empty()
                        && serde_json::from_slice::<serde_json::Value>(&bytes)
                            .is_ok_and(|v| v.get("manifests").is_some()));
                if !is_index {
                    break 'resolve bytes;
                }
                index = parse_json(&bytes, source, &format!("index {}", d.digest))?;
            }
            return Err(bad("image indexes are nested too deeply".into()));
        };
        let manifest: OciManifest = parse_json(&manifest_bytes, source, "image manifest")?;
        let config = read_blob(src, source, &manifest.config.digest)?;
        let mut blobs = Vec::new();
        for l in &manifest.layers {
            let h = valid_digest(&l.digest).ok_or_else(|| bad(format!("unsupported layer digest `{}`", l.digest)))?;
            blobs.push(format!("blobs/sha256/{h}"));
        }
        (config, blobs, "oci")
    } else {
        return Err(LayersError::UnsupportedSource {
            path: source.to_path_buf(),
            reason: "it has neither manifest.json nor index.json".into(),
        });
    };
    let config: ImageConfig = parse_json(&config_bytes, source, "image config")?;
    if config.rootfs.diff_ids.len() != blobs.len() {
        return Err(bad(format!(
            "the config lists {} diff_ids but the manifest {} layers",
            config.rootfs.diff_ids.len(),
            blobs.len()
        )));
    }
    for d in &config.rootfs.diff_ids {
        if valid_digest(d).is_none() {
            return Err(bad(format!("unsupported diff_id `{d}` (only sha256 is supported)")));
        }
    }
    Ok(Parsed {
        id: format!("sha256:{}", hex::encode(Sha256::digest(&config_bytes))),
        layers: config.rootfs.diff_ids.into_iter().zip(blobs).collect(),
        config: config.config.unwrap_or_default(),
        format,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(digest: &str, platform: Option<(&str, &str)>, annotations: &[(&str, &str)]) -> Descriptor {
        Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: digest.into(),
            platform: platform.map(|(os, arch)| Platform { os: os.into(), architecture: arch.into(), variant: None }),
            annotations: (!annotations.is_empty())
                .then(|| annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
        }
    }

    #[test]
    fn selects_host_platform_and_skips_attestations() {
        let descs = vec![
            desc("a", Some(("linux", "arm64")), &[]),
            desc("att", Some(("unknown", "unknown")), &[("vnd.docker.reference.type", "attestation-manifest")]),
            desc("b", Some(("linux", "amd64")), &[]),
        ];
        assert_eq!(select_descriptor(&descs, "amd64").unwrap().digest, "b");
        assert_eq!(select_descriptor(&descs, "arm64").unwrap().digest, "a");
        match select_descriptor(&descs, "riscv64") {
            Err(SelectError::NoMatch(list)) => assert_eq!(list, "linux/arm64, linux/amd64"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn single_manifest_without_platform_is_taken_several_are_ambiguous() {
        let one = vec![desc("x", None, &[("org.opencontainers.image.ref.name", "latest")])];
        assert_eq!(select_descriptor(&one, "amd64").unwrap().digest, "x");
        let two = vec![desc("x", None, &[("org.opencontainers.image.ref.name", "v1")]), desc("y", None, &[])];
        match select_descriptor(&two, "amd64") {
            Err(SelectError::Ambiguous(list)) => assert_eq!(list, "v1, y"),
            other => panic!("{:?}", other.map(|d| &d.digest)),
        }
        assert_eq!(select_descriptor(&[], "amd64").unwrap_err(), SelectError::Empty);
    }

    #[test]
    fn duplicate_layers_keep_topmost() {
        let l = |s: &str| (s.to_string(), format!("blob-{s}"));
        assert_eq!(dedupe_layers(vec![l("a"), l("b"), l("a"), l("c")]), vec![l("b"), l("a"), l("c")]);
    }

    #[test]
    fn compression_sniffing() {
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(sniff(&[0x28, 0xb5, 0x2f, 0xfd, 0]), Compression::Zstd);
        assert_eq!(sniff(b"\xfd7zXZ\0"), Compression::Other("xz"));
        assert_eq!(sniff(b"etc/passwd\0"), Compression::None);
    }

    #[test]
    fn digests() {
        assert!(valid_digest(&format!("sha256:{}", "0".repeat(64))).is_some());
        assert!(valid_digest(&format!("sha512:{}", "0".repeat(64))).is_none());
        assert!(valid_digest("sha256:../../../etc/passwd").is_none());
    }

    #[test]
    fn host_arch_is_oci_name() {
        if cfg!(target_arch = "x86_64") {
            assert_eq!(host_arch(), "amd64");
        }
        assert_ne!(host_arch(), "x86_64");
    }
}
