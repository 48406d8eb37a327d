"""The one C extension, the Kineto event scanner (analyzers/_kineto_scan.c); everything else about the
package is in pyproject.toml.

``optional=True``: on a machine without a C compiler the install still succeeds, and the loader
decodes every batch with msgspec (analyzers/kineto_json.py): a load takes about 1.5x the CPU.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("mfuscope.analyzers._kineto_scan", ["analyzers/_kineto_scan.c"], optional=True)])
