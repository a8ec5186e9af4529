"""The metadata is in pyproject.toml; this file stays for `python setup.py ...` habits and tools
that look for it."""
from setuptools import setup

setup()
