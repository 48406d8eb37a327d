"""mfuscope: why is distributed training slow, and how to make it fast.

Top level holds the core contracts that every part imports (and that import
nothing else of ours): :mod:`mfuscope.event_table`, :mod:`mfuscope.run_dir`,
:mod:`mfuscope.report`, :mod:`mfuscope.hardware`.
"""
__version__ = "0.1.0"


def profile(out_dir, **options):
    """Profile a training run into the run directory ``out_dir``::

        with mfuscope.profile("runs/a", model=model, mesh=mesh, window="5:3") as prof:
            for batch in data:
                ...
                prof.step(tokens=global_tokens, loss=loss)

    See :class:`mfuscope.collectors.session.ProfileSession` for the options.
    """
    from mfuscope.collectors.session import ProfileSession  # needs torch; the analysis side does not

    return ProfileSession(out_dir, **options)
