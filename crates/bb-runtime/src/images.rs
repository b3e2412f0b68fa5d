//! Images: the door to [`bb_layers::ImageStore`] (build with debootstrap, import a `docker save`
//! tarball or an OCI layout, list, remove), with the check that keeps an image's layers while a
//! sandbox, a snapshot or a pool shell stands on them.

use crate::error::{Result, RuntimeError};
use crate::model::*;
use crate::Runtime;
use bb_layers::ImageStore;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc;

pub use bb_layers::BaseImageOpts;

fn image_info(i: &bb_layers::Image) -> ImageInfo {
    ImageInfo {
        name: i.name.clone(),
        id: i.id.clone(),
        layers: i.layers.clone(),
        size_bytes: i.size_bytes,
        created_at: i.created_at,
        source: i.source.clone(),
    }
}

pub enum ImageSource {
    Debootstrap(bb_layers::BaseImageOpts),
    Path(PathBuf),
}

/// Whether a sandbox (recorded in SQLite: its rows, snapshots and layer generations) or a pool
/// shell ([`crate::pool::LayerPins`]) stands on image layer `layer`. In doubt (database unreadable), yes.
pub(crate) fn layer_in_use(db: &Path, pins: &crate::pool::LayerPins, layer: &str) -> bool {
    if pins.holds(layer) {
        return true;
    }
    let in_rows = crate::sandbox::store::SandboxStore::open(db)
        .and_then(|s| s.all())
        .map(|rows| rows.iter().any(|r| r.spec.layers.iter().any(|l| l == layer)))
        .unwrap_or(true);
    let in_snaps = crate::snapshot::store::SnapStore::open(db)
        .and_then(|s| Ok((s.all()?, s.generations()?)))
        .map(|(snaps, gens)| {
            snaps.iter().any(|s| s.layers.iter().any(|l| l == layer))
                || gens.iter().any(|(_, g)| g.chain.iter().chain(&g.mounted).any(|l| l == layer))
        })
        .unwrap_or(true);
    in_rows || in_snaps
}

impl Runtime {
    pub fn images(&self) -> Arc<ImageStore> {
        self.images.clone()
    }

    pub fn list_images(&self) -> Result<ImageList> {
        let images = self.images.list().map_err(RuntimeError::from)?;
        Ok(ImageList { images: images.iter().map(image_info).collect() })
    }

    /// Remove an image no sandbox uses. Its warm pool goes with it: the ready shells are torn
    /// down first (their roots stand on the image's layers) and its pool target is forgotten.
    pub fn remove_image(&self, name: &str) -> Result<()> {
        let in_use: Vec<String> =
            self.sandboxes.all().iter().filter(|s| s.spec.image == name).map(|s| s.id.clone()).collect();
        if !in_use.is_empty() {
            return Err(RuntimeError::Conflict(format!(
                "image {name:?} is used by sandbox(es) {}: kill them first",
                in_use.join(", ")
            )));
        }
        self.forget_pool(name)?;
        self.images.remove(name).map_err(RuntimeError::from)
    }

    /// Build (`source = None`) or import an image on a worker thread, reporting progress.
    pub fn image_job(&self, name: String, source: ImageSource) -> mpsc::Receiver<ProgressEvent> {
        let (tx, rx) = mpsc::channel(256);
        let images = self.images.clone();
        tokio::task::spawn_blocking(move || {
            let mut report = |p: bb_layers::Progress| {
                let ev = match p {
                    bb_layers::Progress::Stage { stage, message } => {
                        ProgressEvent::Progress { stage, done: None, total: None, message }
                    }
                    bb_layers::Progress::Step { stage, done, total } => {
                        ProgressEvent::Progress { stage, done: Some(done), total: Some(total), message: String::new() }
                    }
                };
                let _ = tx.blocking_send(ev);
            };
            let res = match source {
                ImageSource::Debootstrap(opts) => images.build_base(&name, &opts, &mut report),
                ImageSource::Path(p) => images.import(&name, &p, &mut report),
            };
            let last = match res {
                Ok(img) => ProgressEvent::Done { image: image_info(&img) },
                Err(e) => {
                    let e = RuntimeError::from(e);
                    ProgressEvent::Error { error: ErrorBody { code: e.code().into(), message: e.to_string() } }
                }
            };
            let _ = tx.blocking_send(last);
        });
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_of_pool_shells_are_in_use() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("branchbox.db");
        let (_s, _n) = (
            crate::sandbox::store::SandboxStore::open(&db).unwrap(),
            crate::snapshot::store::SnapStore::open(&db).unwrap(),
        );
        let pins = crate::pool::LayerPins::default();
        let layer = format!("local:{}", "1".repeat(32));
        assert!(!layer_in_use(&db, &pins, &layer), "no sandbox, no shell");
        let pin = pins.pin(std::slice::from_ref(&layer));
        assert!(layer_in_use(&db, &pins, &layer), "a shell being built or ready stands on it");
        drop(pin);
        assert!(!layer_in_use(&db, &pins, &layer));
    }
}
