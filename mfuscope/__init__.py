"""mfuscope: why is distributed training slow, and how to make it fast.

Top level holds the core contracts that every part imports (and that import
nothing else of ours): :mod:`mfuscope.event_table`, :mod:`mfuscope.run_dir`,
:mod:`mfuscope.report`, :mod:`mfuscope.hardware`.
"""
__version__ = "0.1.0"
