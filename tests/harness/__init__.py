"""The tests' helpers: stacks, fakes, model packages and the harnesses the suites share; ``harness.probes`` has the
small steps every live test takes (waiting for a condition, one inference).

Imported as ``harness.<module>`` (pyproject's ``pythonpath = ["tests"]``, see tests/conftest.py); nothing here is a
test.
"""
