"""The tests' helpers: stacks, fakes, model packages and the harnesses the suites share.

Imported as ``harness.<module>`` (pyproject's ``pythonpath = ["tests"]``, see tests/conftest.py); nothing here is a
test.
"""
