//! The distributed tuning protocol over a deterministic in-memory message bus: 3 and 5
//! nodes, leader loss, partitions, and the E2E guard.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use gorgo_core::es::{TrialDesign, TuningConfig, Verdict};
use gorgo_core::hash::hash_bytes;
use gorgo_core::tuning::{
    EpochReport, Phase, Proposal, TermSample, Tuner, TuningOutput, TuningRecord,
};
use gorgo_core::{NodeId, Weights};

/// One gossip round of virtual time.
const ROUND_MS: u64 = 250;

/// A cluster of tuners wired by a bus that delivers every message of a round, in
/// order, before the round ends. Partitions and dead nodes drop messages.
struct Bus {
    nodes: BTreeMap<NodeId, Tuner>,
    alive: BTreeSet<NodeId>,
    group: BTreeMap<NodeId, u8>,
    /// `(a, b)`: `a`'s membership view holds `b` dead though their messages flow (an
    /// asymmetric view: `a`'s probes of `b` fail).
    blind: BTreeSet<(NodeId, NodeId)>,
    now: u64,
    records: Vec<TuningRecord>,
    rng: u64,
    requests: u64,
}

impl Bus {
    fn new(n: usize, cfg: TuningConfig) -> Self {
        let ids: Vec<NodeId> = (0..n).map(|i| NodeId(format!("n{i}"))).collect();
        let nodes = ids
            .iter()
            .map(|id| (id.clone(), Tuner::new(id.clone(), cfg).unwrap()))
            .collect();
        Bus {
            nodes,
            alive: ids.iter().cloned().collect(),
            group: ids.iter().map(|id| (id.clone(), 0)).collect(),
            blind: BTreeSet::new(),
            now: 0,
            records: Vec::new(),
            rng: 0x1234_5678,
            requests: 0,
        }
    }

    fn reachable(&self, a: &NodeId, b: &NodeId) -> bool {
        self.alive.contains(a) && self.alive.contains(b) && self.group[a] == self.group[b]
    }

    fn noise(&mut self) -> f64 {
        self.rng = self
            .rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Each live node serves `per_node` requests under its current epoch, each routed
    /// with the weights its key is assigned.
    fn traffic(&mut self, per_node: usize, latency: impl Fn(Weights, f64) -> (f64, f64)) {
        self.traffic_drifting(per_node, |_| 1.0, latency);
    }

    /// [`Bus::traffic`] under a load that scales every latency by `load(now)`.
    fn traffic_drifting(
        &mut self,
        per_node: usize,
        load: impl Fn(u64) -> f64,
        latency: impl Fn(Weights, f64) -> (f64, f64),
    ) {
        let alive: Vec<NodeId> = self.alive.iter().cloned().collect();
        let f = load(self.now);
        for id in alive {
            for _ in 0..per_node {
                let u = self.noise();
                self.requests += 1;
                let key = hash_bytes(&self.requests.to_le_bytes());
                let t = self.nodes.get_mut(&id).unwrap();
                let a = t.admit(key, self.now);
                let (ttft, e2e) = latency(a.weights, u);
                t.record(&a.epoch, a.cell, ttft * f, e2e * f);
            }
        }
    }

    /// Membership views (foca's job) follow liveness and partitions at once.
    fn update_membership(&mut self) {
        let alive: Vec<NodeId> = self.alive.iter().cloned().collect();
        for id in &alive {
            let view: Vec<NodeId> = alive
                .iter()
                .filter(|o| {
                    self.reachable(id, o) && !self.blind.contains(&(id.clone(), (*o).clone()))
                })
                .cloned()
                .collect();
            self.nodes.get_mut(id).unwrap().set_membership(view);
        }
    }

    /// One gossip round: every live node ticks, and everything sent is delivered.
    fn round(&mut self) {
        self.now += ROUND_MS;
        self.update_membership();
        let mut queue: VecDeque<(NodeId, TuningOutput)> = VecDeque::new();
        let alive: Vec<NodeId> = self.alive.iter().cloned().collect();
        for id in &alive {
            let now = self.now;
            for o in self.nodes.get_mut(id).unwrap().tick(now) {
                queue.push_back((id.clone(), o));
            }
        }
        let now = self.now;
        while let Some((from, out)) = queue.pop_front() {
            match out {
                TuningOutput::Broadcast(p) => {
                    for id in &alive {
                        if id != &from && self.reachable(&from, id) {
                            for o in self.nodes.get_mut(id).unwrap().handle_proposal(
                                &from,
                                p.clone(),
                                now,
                            ) {
                                queue.push_back((id.clone(), o));
                            }
                        }
                    }
                }
                TuningOutput::SendProposal { to, proposal } => {
                    if self.reachable(&from, &to) {
                        for o in self
                            .nodes
                            .get_mut(&to)
                            .unwrap()
                            .handle_proposal(&from, proposal, now)
                        {
                            queue.push_back((to.clone(), o));
                        }
                    }
                }
                TuningOutput::SendReport { to, report } => {
                    if self.reachable(&from, &to) {
                        for o in self.nodes.get_mut(&to).unwrap().handle_report(report, now) {
                            queue.push_back((to.clone(), o));
                        }
                    }
                }
                TuningOutput::Record(r) => self.records.push(r),
            }
        }
    }

    /// The proposal each live node of group `g` follows.
    fn views(&self, g: u8) -> Vec<(u64, NodeId, Weights)> {
        self.alive
            .iter()
            .filter(|id| self.group[*id] == g)
            .map(|id| {
                let t = &self.nodes[id];
                let p = t.current().expect("a proposal");
                (p.epoch, p.leader.clone(), t.weights())
            })
            .collect()
    }

    fn assert_agreement(&self, g: u8) {
        let v = self.views(g);
        assert!(
            v.windows(2).all(|w| w[0] == w[1]),
            "group {g} disagrees: {v:?}"
        );
    }
}

fn cfg() -> TuningConfig {
    TuningConfig {
        startup_grace_ms: 2 * ROUND_MS,
        ..TuningConfig::gorgo()
    }
}

fn sequential() -> TuningConfig {
    TuningConfig {
        trial: TrialDesign::Sequential,
        ..cfg()
    }
}

/// Switchback trials in blocks of two rounds (every request of a round is admitted at
/// the round's `now`): the first round of each block is its burn-in, the second is
/// measured.
fn switchback() -> TuningConfig {
    TuningConfig {
        trial: TrialDesign::Switchback,
        switchback_block_ms: 2 * ROUND_MS,
        ..cfg()
    }
}

/// A synthetic cluster: p95 TTFT is best near w_rtt = 1.6, w_queue = 0.6.
fn latency(w: Weights, u: f64) -> (f64, f64) {
    let ttft =
        300.0 + 200.0 * (w.w_rtt - 1.6).powi(2) + 400.0 * (w.w_queue - 0.6).powi(2) + 60.0 * u;
    (ttft, ttft + 2000.0)
}

fn assert_unique_epochs(records: &[TuningRecord]) {
    let mut seen = BTreeSet::new();
    for r in records {
        assert!(
            seen.insert(r.epoch),
            "epoch {} decided twice: {records:#?}",
            r.epoch
        );
    }
}

fn steady_state(n: usize, cfg: TuningConfig) {
    let mut bus = Bus::new(n, cfg);
    let mut last_epoch = 0;
    let mut proposals = 0;
    for _ in 0..400 {
        bus.traffic(8, latency);
        bus.round();
        if bus.now > 2 * ROUND_MS {
            // Every node applies the leader's weights within the round it proposed them.
            bus.assert_agreement(0);
            let (epoch, leader, _) = bus.views(0)[0].clone();
            assert_eq!(leader, NodeId::from("n0"));
            assert!(epoch >= last_epoch);
            if epoch > last_epoch {
                proposals += 1;
            }
            last_epoch = epoch;
        }
    }
    assert!(
        bus.records.len() >= 20,
        "{} records, {proposals} proposals",
        bus.records.len()
    );
    assert_unique_epochs(&bus.records);
    assert!(bus
        .records
        .iter()
        .all(|r| r.samples + r.incumbent_samples >= 128 && r.leader == NodeId::from("n0")));
    match cfg.trial {
        // Both arms in every epoch, about half the requests each; a trial takes one
        // to `max_trial_windows` epochs.
        TrialDesign::Interleaved | TrialDesign::Switchback => {
            let most = u64::from(cfg.max_trial_windows);
            assert!(bus
                .records
                .windows(2)
                .all(|w| (1..=most).contains(&(w[1].epoch - w[0].epoch))));
            // A switchback window's arms are whole blocks: one more block of one arm
            // where the window is not whole pairs.
            let slack = if cfg.trial == TrialDesign::Switchback {
                2
            } else {
                3
            };
            assert!(bus
                .records
                .iter()
                .all(|r| r.samples.abs_diff(r.incumbent_samples)
                    <= (r.samples + r.incumbent_samples) / slack));
        }
        // Candidate epochs alternate with incumbent re-measurements.
        TrialDesign::Sequential => {
            assert!(bus.records.windows(2).all(|w| w[1].epoch == w[0].epoch + 2))
        }
    }
    // The search moved towards the optimum (w_rtt 1.6, w_queue 0.6 from 1.0, 1.0).
    assert!(bus.records.iter().any(|r| r.accepted));
}

#[test]
fn three_nodes_follow_one_leader() {
    steady_state(3, cfg());
    steady_state(3, sequential());
    steady_state(3, switchback());
}

#[test]
fn five_nodes_follow_one_leader() {
    steady_state(5, cfg());
    steady_state(5, sequential());
}

/// Load rising 8% a window, and every candidate 15% better than the start weights: a
/// sequential trial measures the candidate one window after the incumbent, so it sees
/// 0.85 x 1.08 = 0.92, and the drift it measures between incumbent windows inflates its
/// noise margin past that; it never accepts. Interleaved arms see the same load, and
/// switchback arms nearly so.
#[test]
fn drifting_load_fools_sequential_trials_but_not_paired_ones() {
    let start = cfg().start_weights();
    let better = move |w: Weights, u: f64| {
        let f = if w == start { 1.0 } else { 0.85 };
        (300.0 * f + 10.0 * u, 2000.0 + 10.0 * u)
    };
    let window_ms = 4 * ROUND_MS;
    let rising = move |now: u64| 1.08f64.powf(now as f64 / window_ms as f64);
    let mut accepted = Vec::new();
    for cfg in [sequential(), cfg(), switchback()] {
        let mut bus = Bus::new(3, cfg);
        // 3 nodes x 11 requests a round: a 128-request window every 4 rounds.
        for _ in 0..2_000 {
            if bus.records.len() >= 12 {
                break;
            }
            bus.traffic_drifting(11, rising, better);
            bus.round();
        }
        assert!(bus.records.len() >= 12, "{:?}: too few trials", cfg.trial);
        let n = bus.records[..12].iter().filter(|r| r.accepted).count();
        accepted.push((cfg.trial, n, bus.records[..12].to_vec()));
    }
    let (_, seq, seq_records) = &accepted[0];
    let (_, inter, inter_records) = &accepted[1];
    let (_, sb, sb_records) = &accepted[2];
    assert!(
        *sb >= 1 && sb_records[0].accepted,
        "switchback: {sb_records:#?}"
    );
    assert_eq!(*seq, 0, "sequential accepted: {seq_records:#?}");
    assert!(
        *inter >= 1 && inter_records[0].accepted,
        "interleaved: {inter_records:#?}"
    );
    // What each saw of the first trial: the drift, against the candidate's real 15%.
    let ratio = |r: &TuningRecord| r.score_p95_ttft_ms / r.incumbent_p95_ttft_ms;
    assert!(ratio(&seq_records[0]) > 0.88, "{}", ratio(&seq_records[0]));
    assert!((ratio(&inter_records[0]) - 0.85).abs() < 0.03);
    // Switchback blocks alternate within the window, so most of the drift cancels
    // too (the order within each pair is drawn, so some is left).
    assert!((ratio(&sb_records[0]) - 0.85).abs() < 0.05);
}

#[test]
fn leader_loss_mid_epoch_continues_the_line() {
    leader_loss(cfg());
    leader_loss(sequential());
    leader_loss(switchback());
}

fn leader_loss(cfg: TuningConfig) {
    let mut bus = Bus::new(5, cfg);
    while bus.records.len() < 3 {
        bus.traffic(8, latency);
        bus.round();
    }
    // Measure part of an epoch, then lose the leader before it closes.
    bus.traffic(4, latency);
    bus.round();
    let last: Proposal = bus.nodes[&NodeId::from("n0")].current().unwrap().clone();
    assert_eq!(last.leader, NodeId::from("n0"));
    bus.alive.remove(&NodeId::from("n0"));
    let before = bus.records.len();
    // n1 continues the line once n0's lease has run out: the first round at least
    // `leader_lease_ms` after the round n0 last proposed in (a real membership view
    // takes longer than that to call it down).
    let rounds = cfg.leader_lease_ms.div_ceil(ROUND_MS);
    for round in 1..=rounds {
        bus.traffic(4, latency);
        bus.round();
        assert_eq!(
            bus.nodes[&NodeId::from("n1")].is_leader(),
            round == rounds,
            "round {round} of {rounds}"
        );
    }
    let n1 = &bus.nodes[&NodeId::from("n1")];
    let next = n1.current().unwrap();
    assert!(n1.is_leader());
    assert_eq!(next.epoch, last.epoch + 1);
    assert_eq!(next.leader, NodeId::from("n1"));
    // The tuner state continues from the last proposal (the pending incumbent
    // measurement is dropped: it is no longer adjacent to the next candidate; an
    // interleaved trial draws its candidate from the stream where the last stopped).
    let mut expect = last.state.clone();
    expect.pending_incumbent = None;
    expect.pending_trial = None;
    match cfg.trial {
        TrialDesign::Sequential => assert_eq!(next.phase, Phase::MeasureIncumbent),
        TrialDesign::Interleaved | TrialDesign::Switchback => {
            assert_eq!(next.phase, Phase::Interleaved);
            expect.draws += 1;
        }
    }
    assert_eq!(next.state, expect);
    assert_eq!(next.weights, last.state.incumbent);
    bus.assert_agreement(0);
    for _ in 0..150 {
        bus.traffic(8, latency);
        bus.round();
        bus.assert_agreement(0);
    }
    let after = &bus.records[before..];
    assert!(after.len() >= 5);
    assert!(after
        .iter()
        .all(|r| r.leader == NodeId::from("n1") && r.epoch > last.epoch));
    assert_unique_epochs(&bus.records);
}

/// n1's view holds n0 dead while every message still flows (its probes of n0 fail).
/// n0, alive and smallest in its own view, leads; n1 hears its proposals every round
/// and follows. Without the lease n1 took the line over at once, n0 took it back at
/// its next tick, one epoch a round, and no window ever closed.
#[test]
fn an_asymmetric_view_keeps_one_leader() {
    let mut bus = Bus::new(3, cfg());
    bus.blind.insert((NodeId::from("n1"), NodeId::from("n0")));
    for round in 0..300 {
        bus.traffic(8, latency);
        bus.round();
        if round > 2 {
            bus.assert_agreement(0);
            assert_eq!(bus.views(0)[0].1, NodeId::from("n0"), "round {round}");
        }
    }
    assert!(bus.records.len() >= 20, "{} records", bus.records.len());
    assert!(bus.records.iter().all(|r| r.leader == NodeId::from("n0")));
    assert_unique_epochs(&bus.records);
}

#[test]
fn partition_makes_two_leaders_and_healing_resumes_one_line() {
    let mut bus = Bus::new(5, cfg());
    while bus.records.len() < 2 {
        bus.traffic(8, latency);
        bus.round();
    }
    for id in ["n2", "n3", "n4"] {
        bus.group.insert(NodeId::from(id), 1);
    }
    let split = bus.records.len();
    for _ in 0..120 {
        bus.traffic(8, latency);
        bus.round();
        bus.assert_agreement(0);
        bus.assert_agreement(1);
    }
    let during = bus.records[split..].to_vec();
    let leaders: BTreeSet<NodeId> = during.iter().map(|r| r.leader.clone()).collect();
    assert_eq!(
        leaders,
        BTreeSet::from([NodeId::from("n0"), NodeId::from("n2")])
    );
    let max_before_heal = bus.records.iter().map(|r| r.epoch).max().unwrap();

    for id in ["n2", "n3", "n4"] {
        bus.group.insert(NodeId::from(id), 0);
    }
    // One round for the views to merge, one for n0 to take over the higher line.
    bus.traffic(8, latency);
    bus.round();
    bus.traffic(8, latency);
    bus.round();
    bus.assert_agreement(0);
    assert_eq!(bus.views(0)[0].1, NodeId::from("n0"));
    let healed = bus.records.len();
    for _ in 0..120 {
        bus.traffic(8, latency);
        bus.round();
        bus.assert_agreement(0);
    }
    let after = &bus.records[healed..];
    assert!(after.len() >= 5);
    assert!(after
        .iter()
        .all(|r| r.leader == NodeId::from("n0") && r.epoch > max_before_heal));
    assert!(after.windows(2).all(|w| w[1].epoch > w[0].epoch));
    // Within one line, no epoch is decided twice.
    for leader in ["n0", "n2"] {
        let line: Vec<TuningRecord> = bus
            .records
            .iter()
            .filter(|r| r.leader == NodeId::from(leader))
            .cloned()
            .collect();
        assert_unique_epochs(&line);
    }
}

/// The epoch-1 proposal a lone `leader` starts its line with, as on its side of a
/// partition: two sides both run an epoch 1, with different leaders.
fn lone_line(leader: &str) -> Proposal {
    let mut t = Tuner::new(leader.into(), cfg()).unwrap();
    assert!(t.tick(0).is_empty(), "the startup grace");
    let out = t.tick(cfg().startup_grace_ms);
    match out.as_slice() {
        [TuningOutput::Broadcast(p)] => p.clone(),
        other => panic!("{other:?}"),
    }
}

/// The report a follower sends at its next tick, if it has one.
fn report_of(out: &[TuningOutput]) -> Option<(NodeId, EpochReport)> {
    out.iter().find_map(|o| match o {
        TuningOutput::SendReport { to, report } => Some((to.clone(), report.clone())),
        _ => None,
    })
}

/// A request's latencies count in the proposal it was admitted under, epoch *and*
/// leader: after a healed partition moves a node from `(1, n1)` to `(1, n0)`, the
/// requests admitted under `(1, n1)` (routed with n1's weights) that finish later are
/// not counted in `(1, n0)`'s cells, while those admitted and finished under
/// `(1, n0)` are.
#[test]
fn requests_admitted_under_another_leaders_epoch_are_not_counted() {
    let (a, b) = (lone_line("n0"), lone_line("n1"));
    assert_eq!((a.epoch, b.epoch), (1, 1));
    assert!(a.supersedes(&b), "ties go to the smaller leader id");

    let mut node = Tuner::new("n2".into(), cfg()).unwrap();
    node.set_membership(["n0", "n1", "n2"].map(NodeId::from));
    assert!(node.handle_proposal(&"n1".into(), b.clone(), 0).is_empty());
    let stale: Vec<_> = (0..20u64)
        .map(|k| node.admit(hash_bytes(&k.to_le_bytes()), 0))
        .collect();
    assert!(stale
        .iter()
        .all(|s| (s.epoch.epoch(), s.epoch.leader()) == (1, Some(&b.leader))));

    // The partition heals: the node now follows n0's epoch 1.
    assert!(node.handle_proposal(&"n0".into(), a.clone(), 0).is_empty());
    assert_eq!(node.current().unwrap().leader, a.leader);
    assert_eq!(node.epoch(), 1, "the same epoch number");

    // Admitted and finished under (1, n0): counted.
    let sample = TermSample {
        rtt_ms: 10.0,
        queue_ms: 20.0,
        residual_ms: 30.0,
        prefill_ms: 40.0,
    };
    for k in 100..112u64 {
        let fresh = node.admit(hash_bytes(&k.to_le_bytes()), 0);
        node.record(&fresh.epoch, fresh.cell, 300.0, 2000.0);
        assert!(node.record_terms(&fresh.epoch, sample));
    }
    // Half the requests admitted under (1, n1) finish now: not counted.
    let (early, late) = stale.split_at(10);
    for s in early {
        node.record(&s.epoch, s.cell, 300.0, 2000.0);
        assert!(!node.record_terms(&s.epoch, sample));
    }

    let (to, report) = report_of(&node.tick(4 * ROUND_MS)).expect("a report");
    assert_eq!(to, a.leader);
    assert_eq!((report.epoch, &report.leader), (1, &a.leader));
    assert_eq!(report.samples, 12);
    let counted: u64 = report.cells.iter().map(|c| c.ttft.count()).sum();
    assert_eq!(counted, 12);
    assert_eq!(report.terms.n, 12);

    // The rest finish: still nothing new to report.
    for s in late {
        node.record(&s.epoch, s.cell, 300.0, 2000.0);
    }
    assert!(report_of(&node.tick(5 * ROUND_MS)).is_none());
}

#[test]
fn candidate_that_hurts_e2e_beyond_the_guard_is_rejected() {
    let start = cfg().start_weights();
    // Any move away from the start halves TTFT but doubles E2E.
    let hacking = move |w: Weights, u: f64| {
        if w == start {
            (200.0 + u, 1000.0 + u)
        } else {
            (100.0 + u, 2000.0 + u)
        }
    };
    let mut bus = Bus::new(3, cfg());
    while bus.records.len() < 5 {
        bus.traffic(8, hacking);
        bus.round();
    }
    for r in &bus.records {
        assert!(r.score_p95_ttft_ms < r.incumbent_p95_ttft_ms, "{r:?}");
        assert!(!r.accepted);
        assert_eq!(r.verdict, Verdict::E2eGuard);
        assert_eq!(r.incumbent, start);
    }
    // The same improvement without the E2E cost is taken.
    let honest = move |w: Weights, u: f64| {
        if w == start {
            (200.0 + u, 1000.0 + u)
        } else {
            (100.0 + u, 1000.0 + u)
        }
    };
    let mut bus = Bus::new(3, cfg());
    while bus.records.is_empty() {
        bus.traffic(8, honest);
        bus.round();
    }
    assert!(bus.records[0].accepted);
}

#[test]
fn tuning_messages_survive_the_wire_codec() {
    use gorgo_core::tuning::{CellSketches, TermSums, TuningMessage, CELLS};
    use gorgo_core::wire::{decode, encode, MAX_TUNING_MESSAGE};
    let mut bus = Bus::new(3, cfg());
    while bus.records.len() < 2 {
        bus.traffic(8, latency);
        bus.round();
    }
    let p = bus.nodes[&NodeId::from("n0")].current().unwrap().clone();
    let mut cells: [CellSketches; CELLS] = Default::default();
    for i in 0..10_000 {
        let c = &mut cells[i % CELLS];
        c.ttft.add(i as f64 * 0.7);
        c.e2e.add(i as f64 * 3.1);
    }
    let report = EpochReport {
        epoch: p.epoch,
        leader: p.leader.clone(),
        incarnation: 0,
        from: "n1".into(),
        cells: Box::new(cells),
        samples: 10_000,
        terms: TermSums {
            n: 10_000,
            rr: 1e9,
            rq: 2e9,
            qq: 3e9,
            ry: 4e9,
            qy: 5e9,
            yy: 6e9,
            q: 7e9,
            p: 8e9,
        },
        at_ms: 0,
    };
    for msg in [TuningMessage::Proposal(p), TuningMessage::Report(report)] {
        let bytes = encode(&msg);
        assert!(
            bytes.len() < MAX_TUNING_MESSAGE / 8,
            "{} bytes",
            bytes.len()
        );
        let back: TuningMessage = decode(&bytes, MAX_TUNING_MESSAGE).unwrap();
        assert_eq!(back, msg);
        assert!(decode::<TuningMessage>(&bytes[..bytes.len() / 2], MAX_TUNING_MESSAGE).is_err());
    }
}
