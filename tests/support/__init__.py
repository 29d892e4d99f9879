"""What the tests share and pytest does not collect: launchers of servers and child processes, fakes,
and readers of what they serve. Fixtures stay in tests/conftest.py, which imports from here; no test
module imports another (tests/suite/test_suite_layout.py holds it)."""
