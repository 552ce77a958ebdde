"""The two reference servers of ``manage.py bench_latency`` (served by the same daphne as audiosite).

- :mod:`.bare`: a bare ASGI app answering every request with a fixed JSON body
  (what daphne itself costs).
- :mod:`.asgi` with :mod:`.settings`: a minimal ``adrf`` ``APIView`` with no
  middleware, no authentication, no permissions and no database (what Django +
  DRF + adrf cost under Django's stock ``ASGIHandler``; adrf unpatched).

Nothing here is imported by the product.
"""
