//! The committed CRD manifests must be exactly what the Rust types generate.

use imp_testkit::paths;

#[test]
fn committed_crds_match_the_types() {
    let dir = paths::chart_dir().join("crds");
    let mut stale = Vec::new();
    for (file, crd) in imp_api::crds() {
        let generated = imp_api::crd_yaml(&crd).expect("render CRD");
        let committed = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        if committed != generated {
            stale.push(file);
        }
    }
    assert!(
        stale.is_empty(),
        "helm/imp/crds is stale for {stale:?}: run `cargo run -p imp-api --bin crdgen` and commit the result"
    );
    let extra: Vec<_> = std::fs::read_dir(&dir)
        .expect("read helm/imp/crds")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| !imp_api::crds().iter().any(|(f, _)| f == name))
        .collect();
    assert!(
        extra.is_empty(),
        "helm/imp/crds has files no type generates: {extra:?}"
    );
}

#[test]
fn crds_carry_names_columns_and_status_subresource() {
    let expect = [
        (
            "ImpVMClass",
            "Cluster",
            "impcls",
            vec!["VCPU", "Memory"],
            false,
        ),
        (
            "ImpNetwork",
            "Namespaced",
            "impnet",
            vec!["Subnet", "NAT"],
            true,
        ),
        (
            "ImpVM",
            "Namespaced",
            "impvm",
            vec!["Phase", "Node", "IP", "Age"],
            true,
        ),
        (
            "ImpVMRunnerPool",
            "Namespaced",
            "imprp",
            vec!["Desired", "Idle", "Busy", "Age"],
            true,
        ),
    ];
    let crds = imp_api::crds();
    for (kind, scope, short, columns, status) in expect {
        let (_, crd) = crds
            .iter()
            .find(|(_, c)| c.spec.names.kind == kind)
            .unwrap_or_else(|| panic!("no CRD for {kind}"));
        assert_eq!(crd.spec.group, "imp.dev");
        assert_eq!(crd.spec.scope, scope, "{kind} scope");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&[short.to_owned()][..]),
            "{kind} short name"
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["imp".to_owned()][..]),
            "{kind} category"
        );
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        let names: Vec<_> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .filter(|c| c.priority.unwrap_or(0) == 0)
            .map(|c| c.name.as_str())
            .collect();
        for col in columns {
            assert!(
                names.contains(&col),
                "{kind} lacks printer column {col}: {names:?}"
            );
        }
        assert_eq!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            status,
            "{kind} status subresource"
        );
    }
}
