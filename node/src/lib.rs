//! Imp's node half: imp-runtime and imp-agent (see src/bin). The library part is empty until they are built.
