# ignite's own test files are run by test_ignite_suite.py in a tree of their own, never collected here.
collect_ignore = ["upstream"]
