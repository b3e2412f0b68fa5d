//! Compaction of deep snapshot chains.
//!
//! Every checkpoint stacks one more frozen layer under a sandbox's writable layer; overlayfs
//! allows 500 lower layers and each adds lookup cost. When a sandbox's chain holds more than
//! `--max-chain` snapshot layers ([`MAX_CHAIN`] by default), the oldest are merged in the
//! background into one layer (`sl-m*`) that holds only their changes to the image
//! ([`bb_layers::flatten_onto`]), tiered so a compaction's cost is what changed since the last
//! one ([`compaction_plan`]). Then, under the sandbox's operation lock, every snapshot whose
//! chain starts with the merged layers, and every live sandbox's next root, use the new layer:
//! the same files, fewer layers. Mounted roots keep the old layers until their next swap
//! (`Generation::mounted`); the old layers are deleted by the layer collection once nothing
//! uses them ([`crate::layers`]).

use crate::error::RuntimeError;
use crate::layers::du;
use crate::sandbox::launch::layer_dir;
use crate::sandbox::Sandbox;
use crate::Runtime;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Snapshot layers beyond which a chain is compacted in the background (default of
/// `RuntimeConfig::max_chain`).
pub const MAX_CHAIN: usize = 24;

/// Id prefix of layers written by compaction (`sl-m<hex>`: never a plain layer's, whose ids are
/// `sl-<hex>`); they are snapshot layers like any other.
const MERGED_PREFIX: &str = "sl-m";

/// Which part of `chain` (image layers, then snapshot layers `sl-*`, bottom first) a compaction
/// merges, when it holds more than `max_chain` snapshot layers: `Some((from, to))` merges
/// `chain[from..to]` into one layer over the base `chain[..from]`. The newest third of
/// `max_chain` layers is kept as it is (the next checkpoints and rollbacks near the top share
/// them). Layers merged before sit at the bottom as tiers: while there are fewer than that third,
/// a compaction merges only the plain layers above them into one more tier, so its cost is what
/// changed since the last one; then it merges every tier and plain layer into one (the whole
/// diff to the image, once per that many compactions). `None`: nothing to do.
pub(crate) fn compaction_plan(chain: &[String], max_chain: usize) -> Option<(usize, usize)> {
    let image = chain.iter().take_while(|l| !l.starts_with("sl-")).count();
    let snap = chain.len() - image;
    if snap <= max_chain {
        return None;
    }
    let keep = (max_chain / 3).max(1);
    let to = chain.len() - keep;
    let tiers = chain[image..].iter().take_while(|l| l.starts_with(MERGED_PREFIX)).count();
    let from = if tiers < keep { image + tiers } else { image };
    (to >= from + 2).then_some((from, to))
}

/// Compactions in progress: sandbox id -> the layer being written (not recorded yet: the layer
/// collection must keep it).
#[derive(Default)]
pub struct Compaction {
    pub(crate) running: Mutex<HashMap<String, String>>,
}

impl Compaction {
    /// The layers compactions are writing now.
    pub(crate) fn layers_in_progress(&self) -> Vec<String> {
        self.running.lock().values().cloned().collect()
    }
}

impl Runtime {
    /// Compaction: when the sandbox's chain holds more than `max_chain` snapshot layers, merge
    /// the oldest of them into one layer that holds only their changes to the image
    /// ([`bb_layers::flatten_onto`]), off the request path at low priority. Then every snapshot
    /// whose chain starts with the merged ones, and every live sandbox's next root, uses the new
    /// layer instead: the same files, fewer layers. Mounted roots keep the old layers until their
    /// next swap (`Generation::mounted`); snapshots whose whole chain was merged keep theirs.
    /// The old layers are deleted by the layer collection once nothing uses them.
    pub(crate) async fn maybe_compact(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        let Some(chain) = sb.gen.lock().as_ref().map(|g| g.chain.clone()) else { return };
        let Some((from, n)) = compaction_plan(&chain, self.cfg.max_chain) else { return };
        let lid = format!("{MERGED_PREFIX}{}", uuid::Uuid::new_v4().simple());
        {
            let mut c = self.compaction.running.lock();
            if c.contains_key(&sb.id) {
                return; // one at a time per sandbox; the next swap looks again
            }
            c.insert(sb.id.clone(), lid.clone());
        }
        struct Done<'a>(&'a Runtime, &'a str);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.compaction.running.lock().remove(self.1);
            }
        }
        let _done = Done(self, &sb.id);
        let old: Vec<String> = chain[..n].to_vec();
        let t0 = Instant::now();
        let merged = {
            let (rt, old, lid) = (self.clone(), old.clone(), lid.clone());
            tokio::task::spawn_blocking(move || {
                let _nice = bb_sys::process::niced_thread(10);
                let dir = |l: &String| layer_dir(&rt.cfg, &rt.images, l);
                let top: Vec<PathBuf> = old[from..].iter().rev().map(dir).collect();
                let base: Vec<PathBuf> = old[..from].iter().rev().map(dir).collect();
                let dest = dir(&lid);
                let stats = bb_layers::flatten_onto(&top, &base, &dest).map_err(RuntimeError::from)?;
                let t_flat = t0.elapsed();
                let size = du(&dest);
                rt.snapshots.records().set_layer_size(&lid, size)?;
                Ok::<_, RuntimeError>((stats, size, t_flat))
            })
            .await
            .map_err(RuntimeError::Worker)
            .and_then(|r| r)
        };
        let (stats, size, t_flat) = match merged {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, layers = n - from, "compaction of the snapshot chain failed (the chain stays as it is): {e}");
                self.remove_layer_dir(&lid);
                let _ = self.snapshots.records().forget_layer(&lid);
                return;
            }
        };
        // Behind the sandbox's running operation: a checkpoint or rollback records the chain it
        // read at its start, which would undo the switch below.
        let t_merged = t0.elapsed();
        let op = sb.begin_op().await;
        let t_op = t0.elapsed();
        let mut new_prefix = old[..from].to_vec();
        new_prefix.push(lid.clone());
        let replaced = self.snapshots.records().replace_prefix(&old, &new_prefix);
        let rows = match replaced {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, "compaction not recorded (the chain stays as it is): {e}");
                drop(op);
                self.remove_layer_dir(&lid);
                let _ = self.snapshots.records().forget_layer(&lid);
                return;
            }
        };
        // Live sandboxes on the same chain (this one, its forks) mount the new one next time.
        let mut gens = 0;
        let live: Vec<Arc<Sandbox>> = self.sandboxes.all();
        for other in live {
            let mut g = other.gen.lock();
            let Some(gen) = g.as_mut().filter(|g| g.chain.len() >= old.len() && g.chain.starts_with(&old)) else {
                continue;
            };
            let mut chain = new_prefix.clone();
            chain.extend_from_slice(&gen.chain[old.len()..]);
            gen.chain = chain;
            if let Err(e) = self.snapshots.records().set_generation(&other.id, gen) {
                tracing::warn!(sandbox = %other.id, "compacted chain not recorded: {e}");
            }
            gens += 1;
        }
        drop(op);
        if rows == 0 && gens == 0 {
            // Nothing stands on the merged layers any more (deleted or rolled away meanwhile).
            self.remove_layer_dir(&lid);
            let _ = self.snapshots.records().forget_layer(&lid);
            return;
        }
        let depth = chain.iter().filter(|l| l.starts_with("sl-")).count();
        tracing::info!(
            sandbox = %sb.id,
            merged = n - from,
            depth,
            new_depth = depth + 1 - (n - from),
            layer = %lid,
            size,
            files = stats.files,
            whiteouts = stats.whiteouts,
            from_base = stats.from_base,
            snapshots = rows,
            sandboxes = gens,
            flatten_ms = t_flat.as_millis() as u64,
            merged_ms = t_merged.as_millis() as u64,
            op_wait_ms = (t_op - t_merged).as_millis() as u64,
            ms = t0.elapsed().as_millis() as u64,
            "compacted the snapshot chain"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(image: usize, snaps: usize) -> Vec<String> {
        (0..image).map(|i| format!("sha256:{i}")).chain((0..snaps).map(|i| format!("sl-{i}"))).collect()
    }

    #[test]
    fn compaction_merges_new_layers_into_tiers_then_everything_once_there_are_enough() {
        assert_eq!(compaction_plan(&chain(2, 24), 24), None);
        // 25 snapshot layers: the oldest 17 merge over the 2 image layers, the newest 8 stay.
        assert_eq!(compaction_plan(&chain(2, 25), 24), Some((2, 2 + 17)));
        assert_eq!(compaction_plan(&chain(1, 5), 4), Some((1, 1 + 4)));
        // A merged layer (a tier) stays under the next merge while there are fewer than 8.
        let with_tiers = |tiers: usize, plain: usize| {
            let mut c = chain(1, 0);
            c.extend((0..tiers).map(|i| format!("{MERGED_PREFIX}{i}")));
            c.extend(chain(0, plain));
            c
        };
        assert_eq!(compaction_plan(&with_tiers(1, 8), 24), None);
        assert_eq!(compaction_plan(&with_tiers(1, 24), 24), Some((2, 1 + 1 + 16)));
        assert_eq!(compaction_plan(&with_tiers(7, 18), 24), Some((8, 1 + 7 + 10)));
        // 8 tiers: everything but the newest 8 merges into one over the image.
        assert_eq!(compaction_plan(&with_tiers(8, 17), 24), Some((1, 1 + 8 + 9)));
        assert_eq!(compaction_plan(&chain(0, 3), 2), Some((0, 2)));
        assert_eq!(compaction_plan(&chain(3, 0), 2), None);
        // max 2 keeps 1: a tier under one new layer is the whole budget, so tiers merge at once.
        assert_eq!(compaction_plan(&with_tiers(1, 2), 2), Some((1, 3)));
        assert_eq!(compaction_plan(&chain(1, 400), 24), Some((1, 1 + 392)));
    }
}
