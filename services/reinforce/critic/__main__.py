from reinforce.critic.server import main

main()
