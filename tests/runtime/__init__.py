"""Tests of fczero/runtime/."""
