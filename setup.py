"""The one compiled part of pdproxy (everything else is in pyproject.toml): pdproxy/pd/_record.c, optional — without
a C compiler ``pip install`` still succeeds and pdproxy/pd/record.py's Python implementation is used."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdproxy.pd._record", ["pdproxy/pd/_record.c"], optional=True)])
