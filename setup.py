"""The compiled parts of pdproxy (everything else is in pyproject.toml), all optional — without a C compiler
``pip install`` still succeeds and the Python code beside each is used: pdproxy/pd/_record.c (pdproxy/pd/record.py's
Python implementation), pdproxy/pd/_splice.c (pdproxy/pd/splice.py's), pdproxy/http/_chunked.c
(pdproxy/http/server.py's _write_chunk), pdproxy/apis/_jsonscan.c (pdproxy/apis/request.py's bracket bound and
padded parse) and pdproxy/prefix/_textkeys.c (pdproxy/prefix/index.py's py_chunk_keys)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdproxy.pd._record", ["pdproxy/pd/_record.c"], optional=True),
                   Extension("pdproxy.pd._splice", ["pdproxy/pd/_splice.c"], optional=True),
                   Extension("pdproxy.http._chunked", ["pdproxy/http/_chunked.c"], optional=True),
                   Extension("pdproxy.apis._jsonscan", ["pdproxy/apis/_jsonscan.c"], optional=True),
                   Extension("pdproxy.prefix._textkeys", ["pdproxy/prefix/_textkeys.c"], optional=True)])
