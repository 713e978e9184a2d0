//! Warp-specialised roles (`Stmt::Roles`) on the emulator. Each warpgroup of a role runs the
//! role's body as a coroutine of its own (warpgroups run apart on the device, and a role's two
//! consumer warpgroups may take turns through mbarriers of their own): until it begins a loop
//! iteration, or reaches an mbarrier wait whose phase has not completed; then the next takes
//! its turn. So roles whose loops nest differently (a
//! producer over every K step of every tile, consumers over tiles and their K steps with an
//! epilogue between) run as the device may run them, a wait resuming once another role's
//! arrivals or copies complete its phase. Lockstep iterations (a step of each role in turn)
//! are the schedule where the loops match, which puts a refill as close behind the reads it
//! must follow as the device may. A role's `setmaxnreg.inc` waits the same way for registers
//! another role releases. Roles that all wait on what nothing can bring are reported, as a
//! wait in lockstep code is.

use super::{Array, Block, Fault, Val};
use crate::dsl::{Expr, Mbarrier, RegisterChange, Roles, Stmt, Ty};
use std::collections::HashMap;

/// `mask`'s threads a warpgroup at a time, the warpgroups holding none left out.
fn by_warpgroup(mask: &[bool]) -> Vec<Vec<bool>> {
    let warpgroup = super::asynchronous::WARPGROUP;
    (0..mask.len())
        .step_by(warpgroup)
        .filter(|&first| mask[first..(first + warpgroup).min(mask.len())].iter().any(|&m| m))
        .map(|first| {
            (0..mask.len())
                .map(|t| mask[t] && t / warpgroup == first / warpgroup)
                .collect()
        })
        .collect()
}

/// Where one role's run stands.
struct Run<'s> {
    /// The statement lists and loops it is inside, innermost last; none once finished.
    frames: Vec<Frame<'s>>,
    /// Set when it paused at the start of a loop iteration: resumed, it begins it.
    paused: bool,
}

enum Frame<'s> {
    /// `stmts` run in turn by the threads of `mask`, `next` the one to run.
    Seq {
        stmts: &'s [Stmt],
        next: usize,
        mask: Vec<bool>,
    },
    /// A `for` loop over the threads of `mask`: `live` those in the iteration under way (none
    /// before the first), `previous` what its variable held before (restored after).
    Loop {
        var: &'s str,
        end: &'s Expr,
        step: Vec<Val>,
        body: &'s [Stmt],
        mask: Vec<bool>,
        live: Option<Vec<bool>>,
        previous: Option<Vec<Val>>,
    },
}

/// How a role's turn ended.
enum Turn {
    Finished,
    /// At the start of a loop iteration.
    Paused,
    /// At an mbarrier wait whose phase has not completed.
    Waiting,
}

impl<'k> Block<'k> {
    /// Runs the roles to their ends, a turn each of every role's warpgroups in order until all
    /// have finished.
    pub(super) fn roles(&mut self, r: &Roles, mask: &[bool], global: &mut HashMap<String, Array>) -> Result<(), Fault> {
        let masks = self.role_masks(r, mask, global)?;
        let mut runs: Vec<Run> = r
            .roles
            .iter()
            .zip(masks)
            .flat_map(|(role, mask)| {
                by_warpgroup(&mask).into_iter().map(|mask| Run {
                    frames: vec![Frame::Seq {
                        stmts: &role.body,
                        next: 0,
                        mask,
                    }],
                    paused: false,
                })
            })
            .collect();
        loop {
            let (mut unfinished, mut progressed, mut waiting) = (false, false, None);
            for (i, run) in runs.iter_mut().enumerate().filter(|(_, run)| !run.frames.is_empty()) {
                let (turn, moved) = self.turn(run, global)?;
                progressed |= moved;
                match turn {
                    Turn::Finished => {}
                    Turn::Paused => unfinished = true,
                    Turn::Waiting => {
                        unfinished = true;
                        waiting.get_or_insert(i);
                    }
                }
            }
            if !unfinished {
                return Ok(());
            }
            if !progressed {
                // Every role waits and nothing can arrive: the first one's wait reports why.
                let run = &runs[waiting.expect("a role that is not finished and did not move waits")];
                let Some(Frame::Seq { stmts, next, mask }) = run.frames.last() else {
                    unreachable!("a waiting role stands at a statement");
                };
                self.stmt(&stmts[*next], mask, global)?;
                let t = mask.iter().position(|&m| m).unwrap_or(0);
                return Err((t, "every role waits on an mbarrier phase nothing can complete".into()));
            }
        }
    }

    /// The threads of each role, checked: whole warps, one role a thread.
    fn role_masks(
        &mut self,
        r: &Roles,
        mask: &[bool],
        global: &mut HashMap<String, Array>,
    ) -> Result<Vec<Vec<bool>>, Fault> {
        let mut masks = Vec::with_capacity(r.roles.len());
        let mut role_of: Vec<Option<usize>> = vec![None; mask.len()];
        for (i, role) in r.roles.iter().enumerate() {
            let c = self.eval(&role.cond, mask, global)?;
            let m: Vec<bool> = (0..mask.len()).map(|t| mask[t] && c[t].b()).collect();
            for t in (0..mask.len()).filter(|&t| m[t]) {
                if let Some(other) = role_of[t] {
                    return Err((t, format!("is in roles {other} and {i} at once")));
                }
                role_of[t] = Some(i);
            }
            masks.push(m);
        }
        for warp in (0..mask.len()).step_by(32) {
            let mut active = (warp..(warp + 32).min(mask.len())).filter(|&t| mask[t]);
            let Some(first) = active.next() else { continue };
            if let Some(t) = active.find(|&t| role_of[t] != role_of[first]) {
                return Err((t, "a warp split between roles (or none): roles take whole warps".into()));
            }
        }
        Ok(masks)
    }

    /// One turn of a role: it runs until it finishes, pauses at a loop iteration's start or
    /// stops at a wait that cannot complete yet; with whether it got anywhere.
    fn turn<'s>(&mut self, run: &mut Run<'s>, global: &mut HashMap<String, Array>) -> Result<(Turn, bool), Fault> {
        let mut progressed = false;
        loop {
            let Some(frame) = run.frames.last_mut() else {
                return Ok((Turn::Finished, progressed));
            };
            match frame {
                Frame::Seq { stmts, next, mask } => {
                    let stmts: &'s [Stmt] = stmts;
                    if *next == stmts.len() || !mask.iter().any(|&m| m) {
                        run.frames.pop();
                        continue;
                    }
                    let (s, mask) = (&stmts[*next], mask.clone());
                    let ready = match s {
                        Stmt::Mbarrier(m) => match &**m {
                            Mbarrier::Wait { barrier, parity } => {
                                self.wait_completes(barrier, parity, &mask, global)?
                            }
                            _ => true,
                        },
                        Stmt::SetMaxRegisters { change, count } => self.registers_free(*change, *count, &mask)?,
                        _ => true,
                    };
                    if !ready {
                        return Ok((Turn::Waiting, progressed));
                    }
                    *next += 1;
                    progressed = true;
                    match s {
                        Stmt::For {
                            var,
                            start,
                            end,
                            step,
                            body,
                        } => {
                            let frame = self.enter_loop(var, (start, end, step), body, mask, global)?;
                            run.frames.push(frame);
                        }
                        Stmt::If { cond, then, otherwise } => {
                            let c = self.eval(cond, &mask, global)?;
                            let (yes, no) = (0..mask.len())
                                .map(|t| (mask[t] && c[t].b(), mask[t] && !c[t].b()))
                                .unzip();
                            run.frames.push(Frame::Seq {
                                stmts: otherwise,
                                next: 0,
                                mask: no,
                            });
                            run.frames.push(Frame::Seq {
                                stmts: then,
                                next: 0,
                                mask: yes,
                            });
                        }
                        Stmt::Roles(_) => {
                            let t = mask.iter().position(|&m| m).expect("an active thread");
                            return Err((t, "roles inside a role".into()));
                        }
                        other => self.stmt(other, &mask, global)?,
                    }
                }
                Frame::Loop { .. } if !run.paused => {
                    run.paused = true;
                    return Ok((Turn::Paused, progressed));
                }
                Frame::Loop {
                    var,
                    end,
                    step,
                    body,
                    mask,
                    live,
                    previous,
                } => {
                    run.paused = false;
                    progressed = true;
                    if let Some(live) = live {
                        self.loop_step(var, step, live);
                    }
                    let now = self.loop_live(var, end, mask, global)?;
                    if now.iter().any(|&l| l) {
                        let body: &'s [Stmt] = body;
                        *live = Some(now.clone());
                        run.frames.push(Frame::Seq {
                            stmts: body,
                            next: 0,
                            mask: now,
                        });
                        continue;
                    }
                    // Its threads' values as before; other roles' threads keep theirs.
                    let slot = self.vars.get_mut(*var).expect("loop variable");
                    for t in (0..mask.len()).filter(|&t| mask[t]) {
                        slot[t] = previous.as_ref().map_or(Val::Undef, |p| p[t]);
                    }
                    run.frames.pop();
                }
            }
        }
    }

    /// Whether every warpgroup of `mask` may move to `count` registers now: a claim waits for
    /// the pool to hold what it asks.
    fn registers_free(&self, change: RegisterChange, count: u32, mask: &[bool]) -> Result<bool, Fault> {
        for wg in self.registers.warpgroups(mask)? {
            if !self.registers.can_set(wg, change, count as usize)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A `for` loop's frame, its variable set to `start` on `mask`'s threads.
    fn enter_loop<'s>(
        &mut self,
        var: &'s str,
        (start, end, step): (&Expr, &'s Expr, &Expr),
        body: &'s [Stmt],
        mask: Vec<bool>,
        global: &HashMap<String, Array>,
    ) -> Result<Frame<'s>, Fault> {
        let (start, step) = self.loop_start(var, (start, step), &mask, global)?;
        let previous = self.vars.get(var).cloned();
        let slot = self
            .vars
            .entry(var.to_string())
            .or_insert_with(|| vec![Val::Undef; mask.len()]);
        for t in (0..mask.len()).filter(|&t| mask[t]) {
            slot[t] = start[t];
        }
        self.scope.vars.insert(var.to_string(), Ty::I32);
        Ok(Frame::Loop {
            var,
            end,
            step,
            body,
            mask,
            live: None,
            previous,
        })
    }
}
