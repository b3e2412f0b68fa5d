"""The branchbox benchmarks, run as ``branchbox bench SUITE [--json]``:

- ``api`` (:mod:`branchbox_bench.api`): API latencies against a host spawn of ``true``;
- ``cr`` (:mod:`branchbox_bench.cr`): checkpoint, rollback and fork on a real workload
  against copytree and commit baselines (its XFS part runs mkfs.xfs and losetup, as root);
- ``start`` (:mod:`branchbox_bench.start`): starts from the warm pool, cold and from a
  template; idle memory; many sandboxes at once.

They drive the daemon through the public ``branchbox`` SDK only. Nothing here is imported
by ``import branchbox``.
"""
