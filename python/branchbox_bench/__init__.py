"""The branchbox benchmarks, run as ``branchbox bench SUITE [--json]``:

- ``api`` (:mod:`branchbox_bench.api`): API latencies against a host spawn of ``true``;
- ``cr`` (:mod:`branchbox_bench.cr`): checkpoint, rollback and fork on a real workload
  against copytree and commit baselines (its XFS part runs mkfs.xfs and losetup, as root);
- ``start`` (:mod:`branchbox_bench.start`): starts from the warm pool, cold and from a
  template; idle memory; many sandboxes at once;
- ``net`` (:mod:`branchbox_bench.net`): network modes, allowlist against none and a
  sandbox's traffic against the host's, to upstream servers of :mod:`branchbox_bench.networld`
  (a network namespace it brings up, as root);
- ``e2b`` (:mod:`branchbox_bench.e2b`): the daemon's E2B-compatible endpoint, driven by E2B's
  own SDKs (``e2b``, ``e2b-code-interpreter``), against branchbox's SDK on the same daemon.

They drive the daemon through the public ``branchbox`` SDK only (``e2b``: and E2B's SDKs). Nothing here is imported
by ``import branchbox``.
"""
