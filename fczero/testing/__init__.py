"""Test harnesses that ship with fczero, so users can check their own models the same way."""
