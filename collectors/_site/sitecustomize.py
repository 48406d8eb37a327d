"""Put on PYTHONPATH by ``mfuscope profile``: profiles the user's training without a code change.

It only arms a hook (see mfuscope.collectors.autowrap); nothing is imported or
measured until the program imports torch.  Any sitecustomize the environment
already had still runs.
"""
try:
    from mfuscope.collectors import autowrap as _mfuscope_autowrap
except Exception as _e:  # a broken install must not break the user's program
    import sys as _sys
    print(f"mfuscope: not profiling this process: {_e}", file=_sys.stderr)
else:
    _mfuscope_autowrap.arm()
    _mfuscope_autowrap.run_next_sitecustomize(__file__)
