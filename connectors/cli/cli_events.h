/* SPDX-License-Identifier: Apache-2.0 */
/* `kvplane events ...` (cli_events.c). */
#ifndef KVP_CLI_EVENTS_H
#define KVP_CLI_EVENTS_H

/* argv[0] = "events"; returns the exit status. */
int kvp_cli_events(int argc, char **argv);
/* `kvplane events relay` (cli_relay.c); argv[0] = "relay". */
int kvp_cli_relay(int argc, char **argv);

#endif
