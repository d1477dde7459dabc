"""What crosses process boundaries: what two or more services (or other core modules) use; it imports no service
(tests/unit/test_layout.py)."""
