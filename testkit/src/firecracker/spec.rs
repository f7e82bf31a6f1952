//! The part of Firecracker's API (reference/firecracker/firecracker-api.yaml) the
//! simulator serves: routes, and per body definition its required and known properties. A test
//! holds these tables against the spec file, so the simulator cannot drift from it silently.

use serde_json::{Map, Value};

/// Body definition of a route (`#/definitions/<name>`), None for GETs.
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub body: Option<&'static str>,
}

pub const ROUTES: &[Route] = &[
    Route {
        method: "GET",
        path: "/",
        body: None,
    },
    Route {
        method: "PUT",
        path: "/actions",
        body: Some("InstanceActionInfo"),
    },
    Route {
        method: "PUT",
        path: "/boot-source",
        body: Some("BootSource"),
    },
    Route {
        method: "PUT",
        path: "/drives/{drive_id}",
        body: Some("Drive"),
    },
    Route {
        method: "PUT",
        path: "/logger",
        body: Some("Logger"),
    },
    Route {
        method: "GET",
        path: "/machine-config",
        body: None,
    },
    Route {
        method: "PUT",
        path: "/machine-config",
        body: Some("MachineConfiguration"),
    },
    Route {
        method: "PUT",
        path: "/network-interfaces/{iface_id}",
        body: Some("NetworkInterface"),
    },
    Route {
        method: "PUT",
        path: "/vsock",
        body: Some("Vsock"),
    },
    Route {
        method: "PATCH",
        path: "/vm",
        body: Some("Vm"),
    },
    Route {
        method: "PUT",
        path: "/snapshot/create",
        body: Some("SnapshotCreateParams"),
    },
    Route {
        method: "PUT",
        path: "/snapshot/load",
        body: Some("SnapshotLoadParams"),
    },
];

/// A body definition: required and all known properties (as in the spec).
pub struct Definition {
    pub name: &'static str,
    pub required: &'static [&'static str],
    pub properties: &'static [&'static str],
}

pub const DEFINITIONS: &[Definition] = &[
    Definition {
        name: "InstanceActionInfo",
        required: &["action_type"],
        properties: &["action_type"],
    },
    Definition {
        name: "BootSource",
        required: &["kernel_image_path"],
        properties: &["boot_args", "initrd_path", "kernel_image_path"],
    },
    Definition {
        name: "Drive",
        required: &["drive_id", "is_root_device"],
        properties: &[
            "drive_id",
            "partuuid",
            "is_root_device",
            "cache_type",
            "is_read_only",
            "path_on_host",
            "rate_limiter",
            "io_engine",
            "socket",
        ],
    },
    Definition {
        name: "Logger",
        required: &[],
        properties: &[
            "level",
            "log_path",
            "show_level",
            "show_log_origin",
            "module",
        ],
    },
    Definition {
        name: "MachineConfiguration",
        required: &["mem_size_mib", "vcpu_count"],
        properties: &[
            "cpu_template",
            "smt",
            "mem_size_mib",
            "track_dirty_pages",
            "vcpu_count",
            "huge_pages",
        ],
    },
    Definition {
        name: "NetworkInterface",
        required: &["host_dev_name", "iface_id"],
        properties: &[
            "guest_mac",
            "host_dev_name",
            "iface_id",
            "mtu",
            "rx_rate_limiter",
            "tx_rate_limiter",
        ],
    },
    Definition {
        name: "Vsock",
        required: &["guest_cid", "uds_path"],
        properties: &["guest_cid", "uds_path", "vsock_id"],
    },
    Definition {
        name: "Vm",
        required: &["state"],
        properties: &["state"],
    },
    Definition {
        name: "SnapshotCreateParams",
        required: &["mem_file_path", "snapshot_path"],
        properties: &["mem_file_path", "snapshot_path", "snapshot_type"],
    },
    Definition {
        name: "SnapshotLoadParams",
        required: &["snapshot_path"],
        properties: &[
            "enable_diff_snapshots",
            "track_dirty_pages",
            "mem_file_path",
            "mem_backend",
            "snapshot_path",
            "resume_vm",
            "network_overrides",
            "vsock_override",
            "clock_realtime",
            "huge_pages",
        ],
    },
    // The objects nested in SnapshotLoadParams.
    Definition {
        name: "MemoryBackend",
        required: &["backend_type", "backend_path"],
        properties: &["backend_type", "backend_path"],
    },
    Definition {
        name: "NetworkOverride",
        required: &["iface_id", "host_dev_name"],
        properties: &["iface_id", "host_dev_name"],
    },
    Definition {
        name: "VsockOverride",
        required: &["uds_path"],
        properties: &["uds_path"],
    },
];

pub fn definition(name: &str) -> &'static Definition {
    DEFINITIONS
        .iter()
        .find(|d| d.name == name)
        .expect("every route body has a definition")
}

/// Match `path` against the route templates; returns the route and the `{param}` value.
pub fn match_route(method: &str, path: &str) -> Option<(&'static Route, Option<String>)> {
    ROUTES.iter().find_map(|r| {
        if r.method != method {
            return None;
        }
        match r.path.split_once('{') {
            None => (r.path == path).then_some((r, None)),
            Some((prefix, _)) => {
                let rest = path.strip_prefix(prefix)?;
                (!rest.is_empty() && !rest.contains('/')).then(|| (r, Some(rest.to_string())))
            }
        }
    })
}

/// Structural check of a request body against its definition, as Firecracker's deserialiser
/// would: a JSON object, every required property present, no unknown property.
pub fn check_body(def: &Definition, body: &[u8]) -> Result<Map<String, Value>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("Invalid request body: {e}"))?;
    check_object(def, value, true)
}

/// [`check_body`] of an already parsed value (a nested object too). `deny_unknown`: as the
/// struct Firecracker deserialises it into (`#[serde(deny_unknown_fields)]` or not).
pub fn check_object(
    def: &Definition,
    value: Value,
    deny_unknown: bool,
) -> Result<Map<String, Value>, String> {
    let Value::Object(map) = value else {
        return Err(format!(
            "Invalid request body: {} must be a JSON object",
            def.name
        ));
    };
    for field in def.required {
        if !map.contains_key(*field) {
            return Err(format!("Invalid request body: missing field `{field}`"));
        }
    }
    for key in map.keys() {
        if deny_unknown && !def.properties.contains(&key.as_str()) {
            return Err(format!(
                "Invalid request body: unknown field `{key}`, expected one of {:?}",
                def.properties
            ));
        }
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn spec() -> serde_yaml::Value {
        let path = crate::paths::reference_dir().join("firecracker/firecracker-api.yaml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        serde_yaml::from_str(&text).expect("the spec is YAML")
    }

    fn strings(v: &serde_yaml::Value) -> BTreeSet<String> {
        v.as_sequence()
            .map(|s| {
                s.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn every_served_route_exists_in_the_spec_with_its_body_definition() {
        let spec = spec();
        for r in ROUTES {
            let op = &spec["paths"][r.path][r.method.to_lowercase().as_str()];
            assert!(
                op.is_mapping(),
                "{} {} is not in firecracker-api.yaml",
                r.method,
                r.path
            );
            let body_ref = op["parameters"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|p| p["in"].as_str() == Some("body"))
                .and_then(|p| p["schema"]["$ref"].as_str().map(String::from));
            assert_eq!(
                body_ref,
                r.body.map(|d| format!("#/definitions/{d}")),
                "body schema of {} {}",
                r.method,
                r.path
            );
        }
    }

    #[test]
    fn required_and_known_fields_match_the_spec_definitions() {
        let spec = spec();
        for d in DEFINITIONS {
            let def = &spec["definitions"][d.name];
            assert!(
                def.is_mapping(),
                "definition {} missing from the spec",
                d.name
            );
            let required: BTreeSet<String> = d.required.iter().map(|s| s.to_string()).collect();
            assert_eq!(
                required,
                strings(&def["required"]),
                "required fields of {}",
                d.name
            );
            let props: BTreeSet<String> = def["properties"]
                .as_mapping()
                .expect("properties")
                .keys()
                .filter_map(|k| k.as_str().map(String::from))
                .collect();
            let ours: BTreeSet<String> = d.properties.iter().map(|s| s.to_string()).collect();
            assert_eq!(ours, props, "properties of {}", d.name);
        }
        // Every body a route takes is described here.
        for r in ROUTES {
            if let Some(b) = r.body {
                assert!(
                    DEFINITIONS.iter().any(|d| d.name == b),
                    "no definition for {b}"
                );
            }
        }
    }

    #[test]
    fn route_matching_and_body_checks() {
        assert_eq!(
            match_route("PUT", "/drives/rootfs").unwrap().1.as_deref(),
            Some("rootfs")
        );
        assert!(match_route("PUT", "/drives/").is_none());
        assert!(match_route("PUT", "/drives/a/b").is_none());
        assert!(match_route("DELETE", "/vsock").is_none());
        assert!(match_route("GET", "/").is_some());
        let bs = definition("BootSource");
        assert!(check_body(bs, br#"{"kernel_image_path":"/k"}"#).is_ok());
        let e = check_body(bs, br#"{"boot_args":"x"}"#).unwrap_err();
        assert!(e.contains("kernel_image_path"), "{e}");
        assert!(
            check_body(bs, br#"{"kernel_image_path":"/k","bogus":1}"#)
                .unwrap_err()
                .contains("bogus")
        );
        assert!(check_body(bs, b"[]").is_err());
        assert!(check_body(bs, b"{").is_err());
    }
}
