//! Placement rules shared by the operator's scheduler and the agent's pre-build (which builds
//! images only for the pools whose VMs may land on its node).

use k8s_openapi::api::core::v1::{Taint, Toleration};

/// Kubernetes toleration semantics: empty key with Exists matches every taint; empty effect matches every effect.
pub fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    let key = t.key.as_deref().unwrap_or("");
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        "Equal" => {
            !key.is_empty()
                && key == taint.key
                && t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}
