"""Tests of fczero/offload/."""
