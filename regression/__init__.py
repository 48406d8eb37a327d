"""The CI regression gate on MFU (``mfuscope ci``; docs/ci.md).

history        the run history: JSON Lines per workload, fingerprints, append-only
deterministic  the gate on counters that do not depend on timing
statistical    the noise-aware gate on MFU and step time, and change points
statistics     trimmed mean, MAD, Mann-Whitney U, PELT (numpy only)
check          both gates on one run: the verdict and what moved
prediction     the cost model's predicted MFU, a deterministic counter
outputs        markdown (job summary), JUnit XML
trend          the plots over commits (``ci trend``, the HTML report, the dashboard)
simulate       noisy histories from a real report: how the gate's error rates are measured
commands       what the CLI's ``ci record``, ``ci check`` and ``ci trend`` do
"""
