"""The contract's version, recorded in every commit marker: runs already on disk depend on it."""

CONTRACT_VERSION = 1
