"""Test helpers: real daemon processes and a raw protocol client for bad-input tests."""
