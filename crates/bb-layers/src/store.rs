//! The image store: layer directories, the `images` table, commit and garbage collection.

use crate::fsutil::{clean_stale_tmp, random_hex, remove_tree, tree_size, WorkDir};
use crate::{io_err, IdMap, Image, LayersError, Progress};
use nix::fcntl::{Flock, FlockArg};
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::HashSet;
use std::fs::{self, File};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

type InUseCheck = dyn Fn(&str) -> bool + Send + Sync;

/// Images and their layers under one state directory. `Send + Sync`: share it with an `Arc`.
pub struct ImageStore {
    state_dir: PathBuf,
    idmap: IdMap,
    db_path: PathBuf,
    db: Mutex<Connection>,
    in_use: Option<Box<InUseCheck>>,
}

/// A layer unpacked into a private work dir, waiting to be moved into `layers/`.
pub(crate) struct Staged {
    pub id: String,
    pub root: PathBuf,
    pub size: u64,
    pub _work: WorkDir,
}

pub(crate) enum Commit {
    Done(Image),
    /// Layers that were present when the caller checked but were garbage-collected since.
    Missing(Vec<String>),
}

/// `sha256:<64 lowercase hex>` or `local:<32 lowercase hex>`.
pub fn valid_layer_id(id: &str) -> bool {
    let hexok = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    id.strip_prefix("sha256:").is_some_and(|h| hexok(h, 64)) || id.strip_prefix("local:").is_some_and(|h| hexok(h, 32))
}

pub(crate) fn validate_name(name: &str) -> Result<(), LayersError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-:/@+".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(LayersError::InvalidName { name: name.to_string() })
    }
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS images (
    name TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    layers TEXT NOT NULL,      -- JSON array of layer ids, bottom first
    env TEXT NOT NULL,         -- JSON array of KEY=value
    workdir TEXT,
    cmd TEXT NOT NULL,         -- JSON array
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    source TEXT NOT NULL
)";

const COLUMNS: &str = "name, id, layers, env, workdir, cmd, size_bytes, created_at, source";

fn row_to_image(r: &rusqlite::Row<'_>) -> rusqlite::Result<Image> {
    let json = |i: usize| -> rusqlite::Result<Vec<String>> {
        let s: String = r.get(i)?;
        serde_json::from_str(&s)
            .map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e)))
    };
    Ok(Image {
        name: r.get(0)?,
        id: r.get(1)?,
        layers: json(2)?,
        env: json(3)?,
        workdir: r.get(4)?,
        cmd: json(5)?,
        size_bytes: r.get::<_, i64>(6)? as u64,
        created_at: r.get(7)?,
        source: r.get(8)?,
    })
}

impl ImageStore {
    /// Open (creating as needed) the store under `state_dir`: `layers/`, `tmp/`, `cache/` and the
    /// `images` table of `branchbox.db`. Removes work dirs left behind by crashed builds/imports.
    pub fn open(state_dir: &Path, idmap: IdMap) -> Result<ImageStore, LayersError> {
        fs::create_dir_all(state_dir).map_err(io_err(format!("creating state dir {}", state_dir.display())))?;
        // Absolute paths: debootstrap's --cache-dir and overlay layer paths need them.
        let state_dir =
            &fs::canonicalize(state_dir).map_err(io_err(format!("resolving state dir {}", state_dir.display())))?;
        for sub in ["layers", "tmp", "cache"] {
            let p = state_dir.join(sub);
            fs::create_dir_all(&p).map_err(io_err(format!("creating {}", p.display())))?;
            fs::set_permissions(&p, fs::Permissions::from_mode(0o700))
                .map_err(io_err(format!("chmod {}", p.display())))?;
        }
        let db_path = state_dir.join("branchbox.db");
        let dberr = |context| {
            let path = db_path.clone();
            move |source| LayersError::Db { path, context, source }
        };
        let conn = Connection::open(&db_path).map_err(dberr("opening"))?;
        conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(dberr("setting busy timeout"))?;
        conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0)).map_err(dberr("enabling WAL"))?;
        conn.execute(SCHEMA, []).map_err(dberr("creating table images"))?;
        let store =
            ImageStore { state_dir: state_dir.to_path_buf(), idmap, db_path, db: Mutex::new(conn), in_use: None };
        clean_stale_tmp(&store.tmp_dir());
        Ok(store)
    }

    /// Register a check the store asks before deleting an unreferenced layer (on replace/remove/gc):
    /// return true for layer ids a running sandbox still has mounted. Such layers stay on disk
    /// until a later [`ImageStore::gc`] finds them unused.
    pub fn set_layer_in_use_check(&mut self, check: impl Fn(&str) -> bool + Send + Sync + 'static) {
        self.in_use = Some(Box::new(check));
    }

    pub fn idmap(&self) -> IdMap {
        self.idmap
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Directory of a layer: `<state>/layers/<layer_id>`. Ids not of the form `sha256:<hex>` /
    /// `local:<hex>` map to a path that never exists (no path traversal through ids).
    pub fn layer_path(&self, layer_id: &str) -> PathBuf {
        if valid_layer_id(layer_id) {
            self.layers_dir().join(layer_id)
        } else {
            self.layers_dir().join(".invalid-layer-id")
        }
    }

    /// The image's layer dirs in overlay lowerdir order (top-most first), for [`crate::OverlaySpec`].
    pub fn lower_dirs(&self, image: &Image) -> Vec<PathBuf> {
        image.layers.iter().rev().map(|l| self.layer_path(l)).collect()
    }

    pub(crate) fn layers_dir(&self) -> PathBuf {
        self.state_dir.join("layers")
    }

    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.state_dir.join("tmp")
    }

    pub(crate) fn cache_dir(&self) -> PathBuf {
        self.state_dir.join("cache")
    }

    fn db(&self) -> MutexGuard<'_, Connection> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dberr(&self, context: &'static str) -> impl FnOnce(rusqlite::Error) -> LayersError + '_ {
        move |source| LayersError::Db { path: self.db_path.clone(), context, source }
    }

    /// Exclusive lock over layer placement, image records and layer deletion (across processes).
    fn lock(&self) -> Result<Flock<File>, LayersError> {
        let p = self.state_dir.join("layers.lock");
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(io_err(format!("opening {}", p.display())))?;
        Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| LayersError::io(format!("locking {}", p.display()), e.into()))
    }

    pub fn list(&self) -> Result<Vec<Image>, LayersError> {
        let db = self.db();
        let mut st =
            db.prepare(&format!("SELECT {COLUMNS} FROM images ORDER BY name")).map_err(self.dberr("listing images"))?;
        let rows = st.query_map([], row_to_image).map_err(self.dberr("listing images"))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(self.dberr("reading image rows"))
    }

    pub fn get(&self, name: &str) -> Result<Image, LayersError> {
        self.get_opt(name)?.ok_or_else(|| LayersError::NotFound { name: name.to_string() })
    }

    fn get_opt(&self, name: &str) -> Result<Option<Image>, LayersError> {
        let db = self.db();
        db.query_row(&format!("SELECT {COLUMNS} FROM images WHERE name = ?1"), [name], row_to_image)
            .optional()
            .map_err(self.dberr("reading image"))
    }

    fn referenced_layers(&self, db: &Connection) -> Result<HashSet<String>, LayersError> {
        let mut st = db.prepare("SELECT layers FROM images").map_err(self.dberr("reading layer references"))?;
        let rows = st.query_map([], |r| r.get::<_, String>(0)).map_err(self.dberr("reading layer references"))?;
        let mut set = HashSet::new();
        for r in rows {
            let s = r.map_err(self.dberr("reading layer references"))?;
            let v: Vec<String> = serde_json::from_str(&s).unwrap_or_default();
            set.extend(v);
        }
        Ok(set)
    }

    /// Remove the image record, then every layer of it that no remaining image references (and
    /// the in-use check, if set, does not claim).
    pub fn remove(&self, name: &str) -> Result<(), LayersError> {
        let trash = {
            let _lock = self.lock()?;
            let img = self.get(name)?;
            let db = self.db();
            db.execute("DELETE FROM images WHERE name = ?1", [name]).map_err(self.dberr("deleting image"))?;
            let referenced = self.referenced_layers(&db)?;
            drop(db);
            self.trash_unreferenced(img.layers.iter(), &referenced)
        };
        self.empty_trash(trash);
        Ok(())
    }

    /// Delete every layer dir no image references (and the in-use check does not claim), and
    /// stale work dirs. Returns the deleted layer ids.
    pub fn gc(&self) -> Result<Vec<String>, LayersError> {
        let (removed, trash) = {
            let _lock = self.lock()?;
            let referenced = self.referenced_layers(&self.db())?;
            let rd =
                fs::read_dir(self.layers_dir()).map_err(io_err(format!("reading {}", self.layers_dir().display())))?;
            let ids: Vec<String> = rd
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| valid_layer_id(n))
                .collect();
            let trash = self.trash_unreferenced(ids.iter(), &referenced);
            (trash.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(), trash)
        };
        self.empty_trash(trash);
        clean_stale_tmp(&self.tmp_dir());
        Ok(removed)
    }

    /// Under the lock: move unreferenced, unused layers out of `layers/` (a rename, so overlays
    /// still holding them are unaffected). Returns (id, trash path) to delete after unlocking.
    fn trash_unreferenced<'a>(
        &self,
        candidates: impl Iterator<Item = &'a String>,
        referenced: &HashSet<String>,
    ) -> Vec<(String, PathBuf)> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for id in candidates {
            if referenced.contains(id) || !seen.insert(id.clone()) {
                continue;
            }
            if self.in_use.as_ref().is_some_and(|f| f(id)) {
                tracing::info!(layer = %id, "layer unreferenced but in use; keeping it until a later gc");
                continue;
            }
            let src = self.layer_path(id);
            if !src.exists() {
                continue;
            }
            let dst = match random_hex(8) {
                Ok(r) => self.tmp_dir().join(format!("trash-{r}")),
                Err(_) => continue,
            };
            match fs::rename(&src, &dst) {
                Ok(()) => out.push((id.clone(), dst)),
                Err(e) => tracing::warn!(layer = %id, error = %e, "could not move unreferenced layer to trash"),
            }
        }
        out
    }

    /// Delete trashed layers in a background thread: they are already out of `layers/`, and
    /// deleting a few hundred MB can take many seconds. Trash a process leaves behind (exit
    /// before the thread is done) is removed by the next [`ImageStore::open`] / [`ImageStore::gc`].
    fn empty_trash(&self, trash: Vec<(String, PathBuf)>) {
        if trash.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new().name("bb-layers-trash".into()).spawn(move || {
            for (id, p) in trash {
                match remove_tree(&p) {
                    Ok(()) => tracing::info!(layer = %id, "removed unreferenced layer"),
                    Err(e) => tracing::warn!(layer = %id, error = %e, "could not delete unreferenced layer"),
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the layer deletion thread; trash stays in tmp/ until the next gc");
        }
    }

    /// Move staged layers into place, check every layer of `image` exists, record the image
    /// (replacing one of the same name) and delete the replaced image's now-unreferenced layers.
    pub(crate) fn commit(
        &self,
        mut image: Image,
        staged: Vec<Staged>,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Commit, LayersError> {
        progress(Progress::Stage { stage: "commit".into(), message: format!("recording image `{}`", image.name) });
        let mut sizes = std::collections::HashMap::new();
        let trash = {
            let _lock = self.lock()?;
            let mut placed = Vec::new();
            for s in staged {
                let dst = self.layer_path(&s.id);
                sizes.insert(s.id.clone(), s.size);
                if dst.exists() {
                    continue; // someone else stored the same layer meanwhile
                }
                fs::rename(&s.root, &dst).map_err(io_err(format!("moving layer into {}", dst.display())))?;
                placed.push(s.id);
            }
            let missing: Vec<String> = image.layers.iter().filter(|l| !self.layer_path(l).is_dir()).cloned().collect();
            if !missing.is_empty() {
                return Ok(Commit::Missing(missing));
            }
            image.size_bytes = image
                .layers
                .iter()
                .map(|l| sizes.get(l).copied().unwrap_or_else(|| tree_size(&self.layer_path(l))))
                .sum();

            let result = (|| -> Result<Vec<String>, LayersError> {
                let mut db = self.db();
                let tx = db.transaction().map_err(self.dberr("starting transaction"))?;
                let old: Option<String> = tx
                    .query_row("SELECT layers FROM images WHERE name = ?1", [&image.name], |r| r.get(0))
                    .optional()
                    .map_err(self.dberr("reading previous image"))?;
                let js = |v: &Vec<String>| serde_json::to_string(v).unwrap_or_else(|_| "[]".into());
                tx.execute(
                    &format!("INSERT OR REPLACE INTO images ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"),
                    params![
                        image.name,
                        image.id,
                        js(&image.layers),
                        js(&image.env),
                        image.workdir,
                        js(&image.cmd),
                        image.size_bytes as i64,
                        image.created_at,
                        image.source
                    ],
                )
                .map_err(self.dberr("writing image"))?;
                tx.commit().map_err(self.dberr("committing image"))?;
                Ok(old.and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default())
            })();
            let referenced = self.referenced_layers(&self.db())?;
            match result {
                Ok(old_layers) => self.trash_unreferenced(old_layers.iter(), &referenced),
                Err(e) => {
                    // Leave nothing behind: layers we placed that no image uses go again.
                    let t = self.trash_unreferenced(placed.iter(), &referenced);
                    drop(_lock);
                    self.empty_trash(t);
                    return Err(e);
                }
            }
        };
        self.empty_trash(trash);
        Ok(Commit::Done(image))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ids() {
        assert!(valid_layer_id(&format!("sha256:{}", "a".repeat(64))));
        assert!(valid_layer_id(&format!("local:{}", "0f".repeat(16))));
        assert!(!valid_layer_id(&format!("sha256:{}", "A".repeat(64))));
        assert!(!valid_layer_id("sha256:../../etc"));
        assert!(!valid_layer_id(&format!("local:{}", "0".repeat(31))));
    }

    #[test]
    fn names() {
        for ok in ["base", "alpine:3.19", "library/python@x", "a.b_c-d+e"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", "-x", ".x", "a b", "a\nb", &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn layer_path_never_traverses() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::open(dir.path(), IdMap::default()).unwrap();
        assert_eq!(s.layer_path("../../etc"), dir.path().join("layers/.invalid-layer-id"));
        let id = format!("sha256:{}", "b".repeat(64));
        assert_eq!(s.layer_path(&id), dir.path().join("layers").join(&id));
    }

    #[test]
    fn db_roundtrip_and_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let s = ImageStore::open(dir.path(), IdMap::default()).unwrap();
        let id = format!("local:{}", "c".repeat(32));
        let root = dir.path().join("tmp/x");
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/f"), b"12345").unwrap();
        let staged = Staged { id: id.clone(), root, size: 5, _work: WorkDir::new(&s.tmp_dir(), "t").unwrap() };
        let img = Image {
            name: "t".into(),
            id: "sha256:1".into(),
            layers: vec![id.clone()],
            env: vec!["A=b".into()],
            workdir: Some("/w".into()),
            cmd: vec!["sh".into(), "-c".into(), "x y".into()],
            size_bytes: 0,
            created_at: 12.5,
            source: "oci".into(),
        };
        let Commit::Done(done) = s.commit(img.clone(), vec![staged], &mut |_| {}).unwrap() else { panic!("missing") };
        assert_eq!(done.size_bytes, 5);
        assert_eq!(s.get("t").unwrap(), done);
        assert_eq!(s.list().unwrap(), vec![done]);
        assert!(s.layer_path(&id).join("etc/f").is_file());
        // The table is readable by another connection (WAL) with the documented columns.
        let c = Connection::open(dir.path().join("branchbox.db")).unwrap();
        let layers: String = c.query_row("SELECT layers FROM images WHERE name='t'", [], |r| r.get(0)).unwrap();
        assert_eq!(layers, format!("[\"{id}\"]"));
        let mode: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");

        s.remove("t").unwrap();
        assert!(!s.layer_path(&id).exists());
        let e = s.get("t").unwrap_err();
        assert!(matches!(e, LayersError::NotFound { .. }), "{e}");
        assert!(matches!(s.remove("t").unwrap_err(), LayersError::NotFound { .. }));
    }
}
