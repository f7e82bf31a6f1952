//! The mint governor against the simulator: a burst above the limit is paced, none lost.

mod github_common;

use std::time::{Duration, Instant};

use github_common::*;
use imp_operator::github::{GithubConfig, runner_name};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_above_the_limit_is_paced_and_none_is_lost() {
    let sim = sim().await;
    // 600 per minute = one every 100 ms, burst 5.
    let cfg = GithubConfig {
        jit_mints_per_minute: 600,
        jit_mint_burst: 5,
        ..config(&sim)
    };
    let app = app_with(&sim, cfg);
    app.installation_token().await.unwrap();
    let scope = org(&sim);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..25 {
        let app = app.clone();
        let req = jit(scope.clone(), &runner_name("gov", &format!("{i:04}")));
        tasks.push(tokio::spawn(async move {
            let minted = app.generate_jit_config(&req).await.unwrap();
            (start.elapsed(), minted.runner_id)
        }));
    }
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    let total = start.elapsed();
    done.sort();
    let ids: std::collections::BTreeSet<u64> = done.iter().map(|d| d.1).collect();
    assert_eq!(ids.len(), 25, "every mint succeeded");
    assert_eq!(sim.stats().jit_configs_issued, 25);
    // 5 at once, then 20 more at 100 ms intervals: about 2 s.
    assert!(total >= Duration::from_millis(1900), "total {total:?}");
    assert!(total < Duration::from_secs(5), "total {total:?}");
    // The k-th completion (k >= 5) cannot come before (k - 4) * 100 ms.
    for (k, (at, _)) in done.iter().enumerate().skip(5) {
        let floor = Duration::from_millis(100 * (k as u64 - 4)) - Duration::from_millis(30);
        assert!(
            *at >= floor,
            "mint {k} finished at {at:?}, before {floor:?}"
        );
    }
    println!("governor: 25 mints at 600/min burst 5 took {total:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_default_governor_is_150_per_minute_with_a_burst_of_20() {
    let sim = sim().await;
    let defaults = GithubConfig::default();
    assert_eq!(
        (defaults.jit_mints_per_minute, defaults.jit_mint_burst),
        (150, 20)
    );
    let cfg = GithubConfig {
        jit_mints_per_minute: defaults.jit_mints_per_minute,
        jit_mint_burst: defaults.jit_mint_burst,
        ..config(&sim)
    };
    let app = app_with(&sim, cfg);
    app.installation_token().await.unwrap();
    let scope = org(&sim);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..23 {
        let app = app.clone();
        let req = jit(scope.clone(), &runner_name("def", &format!("{i:04}")));
        tasks.push(tokio::spawn(async move {
            app.generate_jit_config(&req).await.map(|_| start.elapsed())
        }));
    }
    let mut times = Vec::new();
    for t in tasks {
        times.push(t.await.unwrap().unwrap());
    }
    times.sort();
    // 20 immediately, then one every 400 ms.
    assert!(
        times[19] < Duration::from_millis(1000),
        "burst of 20: {:?}",
        times[19]
    );
    assert!(
        times[22] >= Duration::from_millis(1150),
        "23rd at {:?}",
        times[22]
    );
    assert!(
        times[22] < Duration::from_secs(5),
        "23rd at {:?}",
        times[22]
    );
    assert_eq!(sim.stats().jit_configs_issued, 23);
    println!(
        "governor default: 23 mints, 21st..23rd at {:?}",
        &times[20..]
    );
}
