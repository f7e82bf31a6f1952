//! Placeholder until this module lands (issue 8 work in progress).
